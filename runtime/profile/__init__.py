"""Routing observed: the router's recorder, the layer-wise profiler, its calibration text, the hot-set report."""
