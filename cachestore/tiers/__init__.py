"""Where chunk bytes live on a node: the Mooncake DRAM pool, the NVMe tier, and the Mooncake servers behind them."""
