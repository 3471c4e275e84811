"""Where KV bytes live: chunk codec, DRAM and NVMe tiers, the node daemon, its REST API and the CLI."""
