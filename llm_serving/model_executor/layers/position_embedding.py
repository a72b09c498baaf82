"""A learned absolute position embedding (GPT-2 / GPTBigCode's ``wpe``), added to the token
embedding: ``hidden[t] += table[positions[t]]``. The table is the same on every rank."""
from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor, ops

from llm_serving.model_executor.cpu_graph import launch
from llm_serving.model_executor.layers.custom_op import CustomOp, cpu_layer_ops, ptr


class PositionEmbedding(CustomOp):
    def __init__(self, max_positions: int, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.weight = Parameter(Tensor(np.zeros((max_positions, hidden_size), np.float32)),
                                name="weight", requires_grad=False)

    def forward_native(self, hidden_states, positions):
        return hidden_states + ops.gather(self.weight, positions, 0)

    def forward_cpu(self, hidden_states, positions):
        """Adds in place: ``hidden_states`` is this step's token embedding, a fresh buffer."""
        launch(cpu_layer_ops().add_rows_f32, ptr(hidden_states), ptr(self.weight),
               ptr(positions), hidden_states.shape[0], self.hidden_size)
        return hidden_states
