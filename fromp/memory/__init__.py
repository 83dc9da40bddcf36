"""How much each example shapes the model: the memory-perturbation equation (sensitivities) and
leave-one-out estimates."""
