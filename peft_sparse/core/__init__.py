"""The one sparse core every method stands on: budget, autograd, layer, tuner, composition."""
