"""Routing observed and replayed: the recorder, the layer-wise profiler, calibration text, reports, trace replay."""
