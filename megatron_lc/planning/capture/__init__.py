"""A step's memory as a trace: ``tracker.py`` counts live bytes per device (storages by identity, fake tensors
too; used by the planner, the estimator's calibration and the rehearsal), ``record.py`` records one micro-batch's
malloc/free sequence with it and marks the layer blocks. Modules are imported by path."""
