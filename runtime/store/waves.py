"""How many of a layer step's experts one wave of the device slots takes (ExpertStore.load_waves, and the projection's
simulation of it): the layer's experts in one wave where the slots hold them all; else half the slots a wave, so that
a wave's copies land in the slots the wave before it does not hold while it computes, instead of waiting for its
compute to free them."""

from __future__ import annotations


def wave_size(experts: int, gpu_slots: int) -> int:
    """Experts a wave holds of a layer step's `experts` (those the device computes) with `gpu_slots` device slots."""
    if experts <= gpu_slots or gpu_slots < 2:
        return gpu_slots
    return gpu_slots // 2
