"""Elastic sub-models outside the forward: resolution of specs against a checkpoint, importance
calibration, extraction, parameter and FLOP accounting."""
