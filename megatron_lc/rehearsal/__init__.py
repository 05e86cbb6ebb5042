"""A rehearsal of a training job at full scale on this CPU (docs/rehearsal.md): the real setup and steps of
``pretrain_gpt.py`` -- config, layout, topology, model from the spec, the technique runtimes' calibration, FSDP2,
the optimizer, the steps -- then validation, a save, an async save and a resume, at the config's real dimensions and
world size, one simulated rank per process, under fake tensors (shapes, dtypes, devices; no values, nothing of size
allocated) on a stand-in accelerator of their own, and a fake process group.

    standin.py   the stand-in device (standin:0): CUDA's autocast rules (standin_autocast.py), CUDA's SDPA kernel
                 choice (standin_sdpa.py); mix_check.py: an op mixing host and device tensors raises where CUDA would
    world.py     the fake process group and the launcher's environment of one simulated rank
    moments.py   where the job is (setup, step, micro-batch, layer, forward/backward, optimizer, its other parts)
    rank.py      one rank: setup + steps + the job (job.py) under the tracker; its figures as a dict (JSON)
    report.py    the ranks' figures beside the estimator's, the phase lines, the summary line, the picture

``tools/rehearse.py`` is the command line."""
