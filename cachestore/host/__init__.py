"""What a process needs of its host: CPU sets and priorities, child processes, listening sockets, secret files,
log rate limits, background threads."""
