"""Runner and generation loop over a model and a cache method."""
