"""What a process needs of its host: CPU sets, child processes, listening sockets, secret files, log rate limits."""
