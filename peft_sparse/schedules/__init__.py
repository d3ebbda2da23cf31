"""Schedules: SpIEL's reselection count k(t), slow-fast rates, the weight decay λ of ``weight_decay: auto``, and the check that a run's learning rate anneals."""
