"""Source tensor names -> dsfp4 names, per family, as data with a completeness check."""
