"""`eaglescale status`: where a run stands, from its run folder alone (no Prefect server).

read.py     the run folder read into plain JSON-able data (`read_status`): markers, progress,
            leases, each later stage's small JSON files, the stage clocks; no rich
render.py   that data drawn with rich (`render_status`)
command.py  the command line (`status_main`): arguments, JSON or the panel, exit codes

Nothing is imported here, so reading the status never loads rich.
"""
