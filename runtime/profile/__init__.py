"""Routing observed: the recorder, the layer-wise profiler, calibration text, reports."""
