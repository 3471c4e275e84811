"""The ways chunks get into vLLM's pages on the connector's worker side (connector/worker_side.py routes a step's
chunks to them): ``DramInPlace`` (dram_in_place.py), ``NvmeLayered`` (nvme_layered.py), ``ThroughSlots``
(through_slots.py), and ``Asynchronous`` (asynchronous.py), which loads whole requests through the others off the
forward pass. base.py says what a loader is; layout.py is the KV cache as they see it.
"""
