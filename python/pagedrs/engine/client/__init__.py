"""The frontend's side of the channel to an engine core: the client (`core_client`), where a core runs
(`core_handles`: a process, a thread, a supervised process; `ray_core`: a Ray actor) and the supervisor
that restarts a core several API server processes share (`core_supervisor`)."""
