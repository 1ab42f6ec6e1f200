"""Stand-in of flashinfer.comm.mapping.Mapping: only the fields the MoE all-to-all reads."""


class Mapping:
    def __init__(self, world_size: int, rank: int, gpus_per_node: int, tp_size: int, moe_ep_size: int) -> None:
        self.world_size, self.rank, self.gpus_per_node, self.tp_size = world_size, rank, gpus_per_node, tp_size
        self.moe_ep_size, self.moe_ep_rank = moe_ep_size, rank
