"""Explanations: Grad-CAM maps computed on the hosted model by an active pass."""
