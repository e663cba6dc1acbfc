"""What measures and shows: the doctor and its ceilings, `dsfp4 bench` and its report, `dsfp4 eval` and its files,
the offline batch's files, the demo (the whole model's projection is dsfp4/projection/)."""
