"""The character LSTM of LEAF's and FedAvg's Shakespeare experiments.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data" (AISTATS 2017, https://arxiv.org/abs/1602.05629), section 3: each character is
embedded in 8 dimensions, two LSTM layers of 256 units read the sequence, and a softmax
layer over the characters predicts the next one. LEAF (Caldas et al. 2018,
models/shakespeare/stacked_lstm.py) and FedACG (Table 8) use the same network, predicting
the character after the last of the seq_len inputs. PyTorch's LSTM keeps two bias vectors
per layer where TensorFlow's keeps one, so there are 4 x hidden x layers (2,048) more
parameters than in LEAF's: 820,185 with the 81-symbol vocabulary.

With its options it is also the word networks of the other text benchmarks: LEAF's
Sent140 (models/sent140/stacked_lstm.py: two LSTM layers of 100 over word embeddings, a
linear layer of 30, then the two classes; LEAF's embeddings are GloVe's 300, frozen,
which no registry here carries, so they are learnt) and TFF's StackOverflow next-word
network (Reddi et al. 2021, "Adaptive Federated Optimization": Embedding(10,004, 96),
LSTM(670), Dense(96), Dense(10,004)). The vocabulary (the embedding's rows) is
``in_channels`` (a text Dataset's ``in_channels``: its vocabulary size), which for the
character and next-word tasks is also ``num_classes``.
"""

from __future__ import annotations

import torch
from torch import nn

from fedmpi.models.classifier import Classifier


class CharLSTM(Classifier):
    """Embedding(V, embed_dim) -> `layers` x LSTM(hidden) -> [Linear(hidden, fc)] ->
    Linear(hidden or fc, num_classes), read after the last token.

    The `build_model` signature is shared with the image models: the vocabulary size V is
    `in_channels` (a text dataset's vocabulary; the same as `num_classes` where inputs and
    targets are ids of one vocabulary); `image_size` (the sequence length) does not change
    the network. With ``pad_id`` >= 0 the inputs are right-padded with that id and each
    is read after its last other token: the LSTM is causal, so that is the output a
    sequence of that length alone would give (TFF's masked padding, at the position it
    scores), and a sequence of pads only is read at its first position.
    """

    def __init__(self, in_channels: int, num_classes: int, image_size: int,
                 embed_dim: int = 8, hidden: int = 256, layers: int = 2, fc: int = 0,
                 pad_id: int = -1):
        super().__init__()
        self.embedding = nn.Embedding(in_channels, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True)
        self.fc = nn.Linear(hidden, fc) if fc else None
        self.classifier = nn.Linear(fc or hidden, num_classes)
        self.pad_id = pad_id

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The top layer's output after the last token (through ``fc`` when there is one),
        [B, hidden or fc]; x is [B, T] ids."""
        out, _ = self.lstm(self.embedding(x.long()))  # .long(): uint8 ids work as well
        if self.pad_id < 0:
            last = out[:, -1]
        else:   # the last position holding another id than pad_id (0 for all-pad rows)
            t = torch.arange(1, x.shape[1] + 1, device=x.device)
            length = ((x != self.pad_id) * t).amax(1).clamp(min=1)
            last = out[torch.arange(len(x), device=x.device), length - 1]
        return last if self.fc is None else self.fc(last)
