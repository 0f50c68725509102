"""Atomic, verifiable checkpoints of a distributed run, and resume from the newest valid one.

Layout (one directory per checkpoint, ``N`` = steps completed)::

    RUN/checkpoints/step-000100/
        model.pt           FULL unpartitioned model state_dict (plain torch, weights_only-safe):
                           loads into the single-process model with torch.load(weights_only=True)
        trainer.pt         optimizer + lr-scheduler state, global like model.pt: the state of a
                           sharded (tensor-parallel) parameter is gathered to its full shape
        rank-00000.pt ...  per rank: RNG states, data-loader position, local buffers
        manifest.json      step, epoch, grid, world size, sha256 + size of every file

Nothing in a checkpoint depends on the grid it was written on, so it resumes on any grid that
fits the job (another spatial split, data width or node count): the model and optimizer state
are global and re-sharded on load; the loader position counts global batches (the sample order
does not depend on the grid, :mod:`hpcpar.data._schedule`); dropout masks hash global
coordinates (:mod:`hpcpar.nn.dropout`), and every rank draws its seeds from the same
generator state. What a rank file holds is therefore the same on every rank of a data group
(buffers may differ between data groups when batch norm does not reduce over them), and a rank
of the new grid takes the file of :func:`hpcpar.run.checkpoint.resume.source_rank`.

One module per concept: :mod:`.capture` gathers and restores the state (model, optimizer,
buffers, RNG), :mod:`.store` is the file protocol (names, manifest, atomic commit, rotation),
:mod:`.resume` the resume policy (which checkpoint, whether it fits this run), :mod:`.finite`
the finiteness checks; the loss history's packing is a record format
(:mod:`hpcpar.formats.records.history`).
"""
