"""Continual-learning methods as plain objects: memorable points, FROMP's regulariser and
method, EWC, VCL (mean-field layers, coresets)."""
