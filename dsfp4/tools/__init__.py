"""What measures and shows: the doctor and its ceilings, `dsfp4 bench` and its report, the demo."""
