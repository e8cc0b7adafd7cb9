"""Small programs in the shape of keras.io examples, for ``tests/test_programs.py``.

Each :class:`Program` is what a keras.io example does, shrunk to a few hundred samples and a
few units: its model (built with a fixed seed), its ``compile`` arguments (fresh objects per
call), its data (``x``, ``y``, and ``fit`` keywords such as ``sample_weight`` or
``class_weight``) and the recipe's batch ``B`` = ``K * b``. The test file runs each one with
plain ``keras.Model.fit`` at ``B`` and with accumcore in both modes, from the same initial
weights.

Where a keras.io example would make exactness impossible by design it is changed, and the
change is named in the builder's docstring: no ``Dropout`` (its random mask depends on how the
batch is cut), and the recommender's per-sample dot product (keras.io's
``ops.tensordot(u, m, 2)`` sums over the whole batch, so each sample's output depends on the
other samples of its batch, as BatchNorm's does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf
from helpers import make_data, seq_data, small_mlp
from keras import layers, ops

N = 100  # samples per program: batches of B = 32 leave a partial last window of 4
MICRO, K = 8, 4  # b and K: B = K * b = 32
B = MICRO * K


class Program(NamedTuple):
    """One keras.io-shaped program.

    ``make()``: the uncompiled model, built (same seed, same weights every call);
    ``compile()``: ``compile`` keywords (a fresh optimizer each call);
    ``data()``: ``(x, y, fit_kwargs)``; ``y`` None where the targets are an input.
    ``tol``: the relative weight error allowed (tests/test_programs.py justifies it).
    ``stock_batchnorm``: the model has stock ``BatchNormalization`` (exactness impossible by
    design: the documented warning naming ``convert_batchnorm`` is checked instead)."""

    make: Callable[[], keras.Model]
    compile: Callable[[], dict]
    data: Callable[[], tuple[Any, Any, dict]]
    tol: float
    stock_batchnorm: bool = False


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def sgd(lr: float = 0.1) -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(lr)


def adam(lr: float = 0.01) -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(lr)


# ------------------------------------------------------------------------ vision: (N, 1) labels
def vision_convnet() -> keras.Model:
    """keras.io "Simple MNIST convnet", 8x8 grey images, 5 classes: Conv2D, MaxPooling2D,
    Flatten, Dense softmax (no Dropout)."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        layers.Conv2D(4, 3, activation="relu"),
        layers.MaxPooling2D(2),
        layers.Flatten(),
        layers.Dense(5, activation="softmax"),
    ])


def vision_data() -> tuple:
    """Images (N, 8, 8, 1) and integer labels of shape (N, 1), as ``mnist.load_data`` labels
    reshaped by many examples (sparse categorical cross-entropy accepts them)."""
    rng = _rng(1)
    x = rng.normal(size=(N, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 5, size=(N, 1)).astype("int32")
    return x, y, {}


# ------------------------------------------------------------------------ text: transformer
TEXT_VOCAB, TEXT_LEN = 30, 10


def text_transformer() -> keras.Model:
    """keras.io "Text classification with Transformer": Embedding(mask_zero=True), one
    MultiHeadAttention block with a residual LayerNormalization and a feed-forward Dense,
    GlobalAveragePooling1D (reads the mask), Dense softmax (no Dropout)."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((TEXT_LEN,), dtype="int32")
    h = layers.Embedding(TEXT_VOCAB, 8, mask_zero=True)(tokens)
    attended = layers.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
    h = layers.LayerNormalization()(layers.Add()([h, attended]))
    h = layers.LayerNormalization()(layers.Add()([h, layers.Dense(8)(
        layers.Dense(16, activation="relu")(h))]))
    h = layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, layers.Dense(2, activation="softmax")(h))


def text_data() -> tuple:
    rng = _rng(2)
    lengths = rng.integers(2, TEXT_LEN + 1, size=N)
    x = np.zeros((N, TEXT_LEN), "int32")
    for i, length in enumerate(lengths):
        x[i, :length] = rng.integers(1, TEXT_VOCAB, size=length)
    return x, rng.integers(0, 2, size=N).astype("int32"), {}


# ------------------------------------------------------------------------ seq2seq
def seq2seq() -> keras.Model:
    """keras.io "Character-level recurrent sequence-to-sequence" with Embedding inputs: a GRU
    encoder's state starts a GRU decoder fed the target shifted right (teacher forcing); the
    decoder's Embedding(mask_zero=True) masks the padded target tokens, so the loss is the
    mean over valid tokens."""
    from helpers import VOCAB

    keras.utils.set_random_seed(0)
    source = keras.Input((None,), dtype="int32", name="source")
    target_in = keras.Input((None,), dtype="int32", name="target_in")
    _, state = layers.GRU(8, return_state=True)(
        layers.Embedding(VOCAB, 6, mask_zero=True)(source))
    h = layers.Embedding(VOCAB + 1, 6, mask_zero=True)(target_in)
    h = layers.GRU(8, return_sequences=True)(h, initial_state=state)
    return keras.Model({"source": source, "target_in": target_in}, layers.Dense(VOCAB)(h))


def seq2seq_data() -> tuple:
    """Copy task: the target is the source; the decoder input is a start token (VOCAB) then
    the target shifted right, zero (masked) after each sequence's end."""
    from helpers import VOCAB

    source, _ = seq_data(N, seed=3, min_len=2)
    target_in = np.zeros_like(source)
    target_in[:, 0] = VOCAB
    target_in[:, 1:] = source[:, :-1]
    target_in[source == 0] = 0
    return {"source": source, "target_in": target_in}, source, {}


def token_loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# ------------------------------------------------------------------------ time series
SERIES_LEN = 16


def series_data(seed: int = 4) -> tuple:
    """Series (N, 16, 2) and a float target of shape (N, 1) (the next value, keras.io
    "Timeseries forecasting" style)."""
    rng = _rng(seed)
    x = rng.normal(size=(N, SERIES_LEN, 2)).astype("float32")
    y = (x[:, -3:, 0].mean(axis=1, keepdims=True) + 0.1 * rng.normal(size=(N, 1)))
    return x, y.astype("float32"), {}


def timeseries_batchnorm(batchnorm: Callable[[], layers.Layer] = layers.BatchNormalization
                         ) -> keras.Model:
    """keras.io "Timeseries classification from scratch" (FCN): Conv1D, stock
    BatchNormalization, ReLU, GlobalAveragePooling1D, Dense (a regression head here)."""
    keras.utils.set_random_seed(0)
    series = keras.Input((SERIES_LEN, 2))
    h = layers.Conv1D(4, 3, padding="same")(series)
    h = layers.ReLU()(batchnorm()(h))
    return keras.Model(series, layers.Dense(1)(layers.GlobalAveragePooling1D()(h)))


def timeseries_lstm() -> keras.Model:
    """keras.io "Timeseries forecasting for weather prediction": LSTM then Dense(1)."""
    keras.utils.set_random_seed(0)
    series = keras.Input((SERIES_LEN, 2))
    return keras.Model(series, layers.Dense(1)(layers.LSTM(6)(series)))


def lstm_data() -> tuple:
    """Series data with per-sample weights (recent samples weigh more)."""
    x, y, _ = series_data(5)
    return x, y, {"sample_weight": np.linspace(0.2, 2.0, N).astype("float32")}


# ------------------------------------------------------------------------ structured data
def structured() -> keras.Model:
    """keras.io "Structured data classification from scratch": named inputs in a dict, a
    Normalization layer adapted to the numeric feature, IntegerLookup one-hot for the
    categorical ones, Dense, sigmoid, binary cross-entropy."""
    keras.utils.set_random_seed(0)
    x, _, _ = structured_data()
    age = keras.Input((1,), name="age")
    sex = keras.Input((1,), dtype="int32", name="sex")
    thal = keras.Input((1,), dtype="int32", name="thal")
    normalise = layers.Normalization()
    normalise.adapt(x["age"])
    encode_thal = layers.IntegerLookup(vocabulary=[1, 2, 3, 7], output_mode="one_hot")
    features = layers.Concatenate()([
        normalise(age), layers.CategoryEncoding(2, output_mode="one_hot")(sex),
        encode_thal(thal)])
    h = layers.Dense(8, activation="relu")(features)
    return keras.Model({"age": age, "sex": sex, "thal": thal},
                       layers.Dense(1, activation="sigmoid")(h))


def structured_data() -> tuple:
    rng = _rng(6)
    x = {"age": rng.uniform(29, 77, size=(N, 1)).astype("float32"),
         "sex": rng.integers(0, 2, size=(N, 1)).astype("int32"),
         "thal": rng.choice([1, 2, 3, 7], size=(N, 1)).astype("int32")}
    return x, rng.integers(0, 2, size=(N, 1)).astype("float32"), {}


# ------------------------------------------------------------------------ multi-output
def multi_output() -> keras.Model:
    """keras.io "functional API" multi-output: one trunk, a classification head and a
    regression head, with different losses and loss_weights."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = layers.Dense(16, activation="tanh")(inputs)
    return keras.Model(inputs, {"kind": layers.Dense(3, activation="softmax", name="kind")(h),
                                "score": layers.Dense(1, name="score")(h)})


def multi_output_data() -> tuple:
    x, y = make_data(N, seed=7)
    score = x[:, :1] * 0.5
    return x, {"kind": y, "score": score}, {}


# ------------------------------------------------------------------------ custom loss
@keras.saving.register_keras_serializable(package="accumcore_programs")
class FocalLoss(keras.losses.Loss):
    """A ``Loss`` subclass returning one value per sample (keras.io "Imbalanced
    classification" style focal loss on sparse labels); reduced by Keras (mean over samples)."""

    def __init__(self, gamma: float = 2.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gamma = gamma

    def call(self, y_true, y_pred):
        probs = ops.take_along_axis(
            y_pred, ops.expand_dims(ops.cast(ops.reshape(y_true, (-1,)), "int32"), -1), axis=-1)
        probs = ops.clip(ops.squeeze(probs, -1), 1e-7, 1.0)
        return -((1.0 - probs) ** self.gamma) * ops.log(probs)


def custom_loss_data() -> tuple:
    x, y = make_data(N, seed=8)
    return x, y, {}


# ------------------------------------------------------------------------ recommender
USERS, MOVIES = 12, 15


class RecommenderNet(keras.Model):
    """keras.io "Collaborative filtering for movie recommendations": user and movie Embedding
    towers with biases, their dot product, sigmoid. Per-sample dot product (``ops.sum`` of the
    product over the embedding axis): keras.io's ``ops.tensordot(u, m, 2)`` contracts the batch
    axis too, which makes each output depend on the whole batch."""

    def __init__(self, size: int = 4, **kwargs) -> None:
        super().__init__(**kwargs)
        regularizer = keras.regularizers.l2(1e-3)
        self.user_embedding = layers.Embedding(USERS, size, embeddings_regularizer=regularizer)
        self.user_bias = layers.Embedding(USERS, 1)
        self.movie_embedding = layers.Embedding(MOVIES, size,
                                                embeddings_regularizer=regularizer)
        self.movie_bias = layers.Embedding(MOVIES, 1)

    def call(self, inputs):
        user, movie = inputs[:, 0], inputs[:, 1]
        dot = ops.sum(self.user_embedding(user) * self.movie_embedding(movie), axis=1,
                      keepdims=True)
        return ops.sigmoid(dot + self.user_bias(user) + self.movie_bias(movie))


def recommender() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = RecommenderNet()
    model(np.zeros((1, 2), "int32"))
    return model


def recommender_data() -> tuple:
    rng = _rng(9)
    pairs = np.stack([rng.integers(0, USERS, N), rng.integers(0, MOVIES, N)], 1)
    return pairs.astype("int32"), rng.uniform(0, 1, size=(N, 1)).astype("float32"), {}


# ------------------------------------------------------------------------ OCR with CTC
OCR_W, OCR_H, OCR_CLASSES, OCR_LABEL = 16, 8, 6, 3  # class 0 is CTC's blank


class CTCLayer(layers.Layer):
    """keras.io "OCR model for reading Captchas": an endpoint layer that adds the per-sample
    CTC loss (shape (batch, 1); Keras sums what ``add_loss`` is given) and returns the
    predictions."""

    def call(self, labels, logits):
        batch = ops.shape(labels)[0]
        label_length = ops.full((batch,), OCR_LABEL, "int32")
        logit_length = ops.full((batch,), ops.shape(logits)[1], "int32")
        loss = ops.ctc_loss(labels, logits, label_length, logit_length, mask_index=0)
        self.add_loss(ops.expand_dims(loss, 1))
        return logits


def ocr_ctc() -> keras.Model:
    keras.utils.set_random_seed(0)
    image = keras.Input((OCR_W, OCR_H, 1), name="image")
    labels = keras.Input((OCR_LABEL,), dtype="int32", name="label")
    h = layers.Conv2D(4, 3, padding="same", activation="relu")(image)
    h = layers.MaxPooling2D(2)(h)  # (W / 2, H / 2, 4)
    h = layers.Reshape((OCR_W // 2, OCR_H // 2 * 4))(h)
    h = layers.Dense(8, activation="relu")(h)
    logits = layers.Dense(OCR_CLASSES)(h)
    return keras.Model({"image": image, "label": labels}, CTCLayer()(labels, logits))


def ocr_data() -> tuple:
    rng = _rng(10)
    x = {"image": rng.normal(size=(N, OCR_W, OCR_H, 1)).astype("float32"),
         "label": rng.integers(1, OCR_CLASSES, size=(N, OCR_LABEL)).astype("int32")}
    return x, None, {}


# ------------------------------------------------------------------------ autoencoder
class FoldLastAxes(layers.Layer):
    """Reads static inner shapes in ``build`` and ``call`` (``shape[-1]``, ``shape[-2]``), as
    many keras.io layers do: folds (batch, a, c) into (batch, a * c) and scales each channel."""

    def build(self, input_shape) -> None:
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return ops.reshape(x * self.scale, (-1, x.shape[-2] * x.shape[-1]))


def autoencoder() -> keras.Model:
    """keras.io "Convolutional autoencoder"-shaped dense autoencoder of 4x4 images: a layer
    reading the input's static shape folds it to 16, encode to 8, decode to 16, Reshape back to
    (4, 4)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 4))
    h = layers.Dense(8, activation="tanh")(FoldLastAxes()(inputs))
    return keras.Model(inputs, layers.Reshape((4, 4))(layers.Dense(16)(h)))


def reconstruction_error(y_true, y_pred):
    """A plain function loss: per-sample mean squared error."""
    return ops.mean(ops.square(y_true - y_pred), axis=-1)


def autoencoder_data() -> tuple:
    x = _rng(11).normal(size=(N, 4, 4)).astype("float32")
    return x, x, {}


# ------------------------------------------------------------------------ class weights
def class_weight_data() -> tuple:
    x, y = make_data(N, seed=12)
    return x, y, {"class_weight": {0: 1.0, 1: 3.0, 2: 0.5}}


# ------------------------------------------------------------------------ raw strings
WORDS = ("good", "bad", "fine", "awful", "movie", "plot", "great", "dull", "actor", "long")


def strings_data() -> tuple:
    """Raw text (N, 1) of 2 to 7 words and a float label (N,)."""
    rng = _rng(13)
    text = [[" ".join(rng.choice(WORDS, size=rng.integers(2, 8)))] for _ in range(N)]
    # A string tensor: Keras 3.15's fit refuses numpy string arrays ("Invalid dtype").
    return tf.constant(text), rng.integers(0, 2, size=N).astype("float32"), {}


def text_vectorization() -> keras.Model:
    """keras.io "Text classification from scratch", end to end: raw strings into an adapted
    TextVectorization inside the model, Embedding(mask_zero=True), GlobalAveragePooling1D,
    Dense sigmoid, binary cross-entropy."""
    keras.utils.set_random_seed(0)
    vectorize = layers.TextVectorization(max_tokens=16, output_sequence_length=8)
    vectorize.adapt(strings_data()[0][:, 0])
    text = keras.Input((1,), dtype="string")
    h = layers.Embedding(16, 4, mask_zero=True)(vectorize(text))
    return keras.Model(text, layers.Dense(1, activation="sigmoid")(
        layers.GlobalAveragePooling1D()(h)))


# ------------------------------------------------------------------------ the list
# Tolerances (relative weight error max|w - w_ref| / max|w_ref - w_0|, float32): measured
# 7e-8 .. 3.2e-7 with SGD and 7.5e-7 .. 1.5e-6 with Adam; tests/test_programs.py justifies them.
TOL_SGD = 1e-5
TOL_ADAM = 2e-5

PROGRAMS: dict[str, Program] = {
    "vision_n1_labels": Program(
        vision_convnet, lambda: dict(optimizer=adam(), loss="sparse_categorical_crossentropy",
                                     metrics=["accuracy"]), vision_data, TOL_ADAM),
    "text_transformer": Program(
        text_transformer, lambda: dict(optimizer=sgd(), loss="sparse_categorical_crossentropy",
                                       metrics=["accuracy"]), text_data, TOL_SGD),
    "seq2seq_teacher_forcing": Program(
        seq2seq, lambda: dict(optimizer=sgd(0.5), loss=token_loss()), seq2seq_data, TOL_SGD),
    "timeseries_batchnorm": Program(
        timeseries_batchnorm, lambda: dict(optimizer=adam(), loss="mse"), series_data,
        TOL_ADAM, stock_batchnorm=True),
    "timeseries_lstm_sample_weight": Program(
        timeseries_lstm, lambda: dict(optimizer=adam(), loss="mse"), lstm_data, TOL_ADAM),
    "structured_data_dict_inputs": Program(
        structured, lambda: dict(optimizer=adam(), loss="binary_crossentropy",
                                 metrics=["accuracy"]), structured_data, TOL_ADAM),
    "multi_output_loss_weights": Program(
        multi_output, lambda: dict(optimizer=sgd(), loss={
            "kind": "sparse_categorical_crossentropy", "score": "mse"},
            loss_weights={"kind": 1.0, "score": 0.5}), multi_output_data, TOL_SGD),
    "custom_loss_subclass": Program(
        lambda: small_mlp(), lambda: dict(optimizer=adam(), loss=FocalLoss()),
        custom_loss_data, TOL_ADAM),
    "recommender_two_towers": Program(
        recommender, lambda: dict(optimizer=sgd(0.5), loss="binary_crossentropy"),
        recommender_data, TOL_SGD),
    "ocr_ctc_endpoint": Program(
        ocr_ctc, lambda: dict(optimizer=adam()), ocr_data, TOL_ADAM),
    "autoencoder_reshape_function_loss": Program(
        autoencoder, lambda: dict(optimizer=adam(), loss=reconstruction_error),
        autoencoder_data, TOL_ADAM),
    "text_vectorization_raw_strings": Program(
        text_vectorization, lambda: dict(optimizer=sgd(0.5), loss="binary_crossentropy"),
        strings_data, TOL_SGD),
    "class_weights": Program(
        lambda: small_mlp(), lambda: dict(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss="sparse_categorical_crossentropy"),
        class_weight_data, TOL_SGD),
}
