"""The character LSTM of LEAF's and FedAvg's Shakespeare experiments.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data" (AISTATS 2017, https://arxiv.org/abs/1602.05629), section 3: each character is
embedded in 8 dimensions, two LSTM layers of 256 units read the sequence, and a softmax
layer over the characters predicts the next one. LEAF (Caldas et al. 2018,
models/shakespeare/stacked_lstm.py) and FedACG (Table 8) use the same network, predicting
the character after the last of the seq_len inputs. PyTorch's LSTM keeps two bias vectors
per layer where TensorFlow's keeps one, so there are 4 x hidden x layers (2,048) more
parameters than in LEAF's: 820,185 with the 81-symbol vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from fedmpi.models.classifier import Classifier


class CharLSTM(Classifier):
    """Embedding(V, embed_dim) -> `layers` x LSTM(hidden) -> Linear(hidden, V) on the last step.

    The `build_model` signature is shared with the image models: the vocabulary size V is
    `num_classes` (inputs and targets are ids of the same characters); `in_channels` and
    `image_size` (the sequence length for text) do not change the network.
    """

    def __init__(self, in_channels: int, num_classes: int, image_size: int,
                 embed_dim: int = 8, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.embedding = nn.Embedding(num_classes, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True)
        self.classifier = nn.Linear(hidden, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The top layer's output after the last character, [B, hidden]; x is [B, T] ids."""
        out, _ = self.lstm(self.embedding(x.long()))  # .long(): uint8 ids work as well
        return out[:, -1]
