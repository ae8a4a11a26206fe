"""SGLang as eaglescale knows it without importing it: each pinned version's recorded
`launch_server --help` (recorded_flags) and its flag table and launch checks (versions)."""
