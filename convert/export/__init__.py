"""A converted model written as another engine's checkpoint (`dsfp4 export`)."""
