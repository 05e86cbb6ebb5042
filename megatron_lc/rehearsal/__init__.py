"""A rehearsal of the training step at full scale on this CPU (docs/rehearsal.md): the real setup and steps of
``pretrain_gpt.py`` -- config, layout, topology, model from the spec, the technique runtimes' calibration, FSDP2,
the optimizer, the steps -- at the config's real dimensions and world size, one simulated rank per process, under
fake tensors (shapes, dtypes, devices; no values, nothing of size allocated) and a fake process group.

    world.py     the fake process group and the launcher's environment of one simulated rank
    moments.py   where the step is (setup, step, micro-batch, layer, forward/backward, optimizer), on the trace
    rank.py      one rank: setup + steps under the tracker; its figures as a dict (JSON)
    report.py    the ranks' figures beside the estimator's, the summary line, the picture

``tools/rehearse.py`` is the command line."""
