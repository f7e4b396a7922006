"""Developer replay: record drives, replay them deterministically through the real
sandboxed pipeline, compare runs, and replay fleets of logs.

    logfmt     the on-disk format (framed capnp stream, video + per-frame index)
    drivelog   writing and reading whole logs
    derive     record/replay configs derived from the user's config
    record     ``supervisor record``
    run        ``supervisor replay`` (one log): the driver, summary.json, plot.png
    diff       ``--ref``: per-channel, per-field comparison, Markdown
    fleet      many logs: ``--jobs N`` here, or ``--ray ADDRESS``
"""
