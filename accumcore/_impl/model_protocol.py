"""``AccumModel``'s side of Keras's model protocols, outside the class that trains.

* Construction: the functional form as a subclass of its own (:func:`model_class`), and the
  keyword check a functional ``keras.Model`` does not do (:func:`check_keywords`).
* Config round-trips: ``get_config`` / ``from_config`` (:func:`config_settings`,
  :func:`split_config`) and the compile config that carries the settings through
  ``keras.models.clone_model`` (:func:`with_settings`, :func:`compile_from_config`).
* The accumulation state in weight files: :class:`AccumulationStore`, under a path of its
  own so that a plain ``keras.Model`` of the same layers loads the file (serving).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import keras
import numpy as np

from accumcore._impl import building, compat, entry
from accumcore._impl.config import check_optimizer
from accumcore._impl.layout import saved_micro_step

#: The accumulation settings, as ``get_config`` and ``set_accumulation`` name them.
CONFIG_KEYS = ("accum_steps", "end_of_epoch", "nonfinite", "normalizer")
#: Key under which ``get_compile_config()`` carries the accumulation settings.
COMPILE_KEY = "accumcore_accumulation"

# The functional form of each AccumModel class (cls + Keras's Functional), made once.
_FUNCTIONAL_VARIANTS: dict[type, type] = {}


def is_functional_call(args: tuple, kwargs: dict) -> bool:
    """Same rule as Keras: ``(inputs, outputs)`` positionally or by keyword."""
    return len(args) == 2 or (len(args) == 1 and "outputs" in kwargs) or (
        "inputs" in kwargs and "outputs" in kwargs
    )


def model_class(cls: type, args: tuple, kwargs: dict) -> type:
    """The class ``AccumModel.__new__`` instantiates for these arguments.

    Called functionally, Keras would rewrite ``cls``'s bases to include Functional,
    permanently, which breaks later *subclassing* of ``cls`` in the same process. The
    functional form is a separate subclass (``cls`` + Functional) instead, registered for
    saving under ``cls``'s registered name.
    """
    functional = compat.functional_model_class()
    if not is_functional_call(args, kwargs) or issubclass(cls, functional):
        return cls
    if cls not in _FUNCTIONAL_VARIANTS:
        variant = type(cls.__name__, (cls, functional),
                       {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        registered = keras.saving.get_registered_name(cls)
        if ">" in registered:  # saved and loaded under the class's registered name
            package, name = registered.split(">", 1)
            keras.saving.register_keras_serializable(package, name)(variant)
        _FUNCTIONAL_VARIANTS[cls] = variant
    return _FUNCTIONAL_VARIANTS[cls]


def keras_keywords(functional: bool) -> tuple[str, ...]:
    """Keyword arguments ``keras.Model.__init__`` uses (read in Keras 3.10 and 3.15).

    Functional form: ``Functional.__init__(inputs, outputs, name=None, **kwargs)`` pops
    ``trainable`` and silently ignores every other keyword. Subclassed form: the keywords of
    ``keras.layers.Layer.__init__`` (read from its signature) plus ``input_shape`` /
    ``input_dim``, which it also pops (it rejects anything else itself, with a ValueError).
    """
    if functional:
        return ("inputs", "outputs", "name", "trainable")
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [p.name for p in inspect.signature(keras.layers.Layer.__init__).parameters.values()
             if p.kind in kinds and p.name != "self"]
    return tuple(dict.fromkeys([*names, "input_shape", "input_dim"]))


def check_keywords(kwargs: dict, functional: bool) -> None:
    """Raise ``TypeError`` for a keyword ``keras.Model`` would not use (a functional model
    silently ignores it, so ``accumulation_steps=4`` would train with K = 1 unnoticed)."""
    known = keras_keywords(functional)
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        raise TypeError(
            f"AccumModel got unexpected keyword argument(s) {', '.join(unknown)}; valid "
            f"keywords: {', '.join((*CONFIG_KEYS, *known))}. (K, the number of "
            "micro-batches per optimizer update, is `accum_steps`.)"
        )


def settings(model) -> dict:
    """The model's accumulation settings, by :data:`CONFIG_KEYS`."""
    return {k: getattr(model, k) for k in CONFIG_KEYS}


def config_settings(model) -> dict:
    """The settings ``get_config`` adds; raises ``ValueError`` for one that cannot be
    serialised (a callable normaliser, a custom non-finite policy)."""
    if callable(model.normalizer):
        raise ValueError(
            "An AccumModel with a callable `normalizer` cannot be serialised; pass "
            "normalizer='auto', 'samples' or 'sample_weight', or re-create the model in code."
        )
    if not isinstance(model.nonfinite, str):
        raise ValueError(
            f"An AccumModel with a custom NonFinitePolicy ({model.nonfinite.name!r}) cannot "
            "be serialised; pass nonfinite='raise', 'skip_micro_batch' or 'skip_window', "
            "or re-create the model in code."
        )
    return settings(model)


def split_config(config: dict) -> tuple[dict, dict]:
    """``(Keras's config, the accumulation settings)`` of a ``get_config`` result."""
    config = dict(config)
    return config, {k: config.pop(k) for k in CONFIG_KEYS if k in config}


def with_settings(config: dict | None, model) -> dict | None:
    """Keras's compile config with the model's settings under :data:`COMPILE_KEY`."""
    return None if config is None else {**config, COMPILE_KEY: settings(model)}


def compile_from_config(model, config: dict) -> None:
    """``keras.Model.compile_from_config``, then the settings of :func:`with_settings`."""
    config = dict(config)
    given = config.pop(COMPILE_KEY, None)
    # What keras.Model.compile_from_config does (Keras 3.10-3.15), which skips a
    # `compile` that a subclass overrides, as AccumModel does (to count the losses).
    config = keras.saving.deserialize_keras_object(config)
    model.compile(**config)
    if getattr(model, "optimizer", None) is not None and model.built:
        model.optimizer.build(model.trainable_variables)
    if given:
        model.set_accumulation(**given)


class AccumulationStore(keras.layers.Layer):
    """Saves and loads an ``AccumModel``'s accumulation state under its own path in the file.

    Keras's weight files give every object a path; a model's own path holds only its own
    variables (none for a Functional model). Keeping the accumulation state under this child
    path (``_accumulation_store/vars``) instead of the model's own path means that
    ``load_weights`` into a plain ``keras.Model`` with the same layers (serving) finds exactly
    the variables it expects and ignores this entry, while an ``AccumModel`` restores its
    half-full window from it. It is not tracked as a layer (not in ``model.layers`` or
    ``model.weights``); ``tf.train.Checkpoint`` tracks ``model.accumulation`` directly.
    """

    def __init__(self, model) -> None:
        super().__init__(name="accumulation_store", trainable=False)
        # A weak reference, untracked: Keras's saving walks this layer's attributes, and a
        # strong one would lead it back to the model (a cycle); no tracking either.
        object.__setattr__(self, "_model", weakref.ref(model))
        self.built = True

    def save_own_variables(self, store) -> None:
        for i, value in enumerate(values_to_save(self._model())):
            store[str(i)] = value

    def load_own_variables(self, store) -> None:
        keys = list(store.keys()) if store is not None else []
        if keys:
            # numpy arrays: Keras 3.10 hands over h5py datasets, 3.15 arrays
            restore(self._model(), [np.asarray(store[str(i)]) for i in range(len(keys))])


def values_to_save(model) -> list[Any]:
    """The accumulation state's values (numpy), in the file's order; empty: nothing to save."""
    if not model.accumulation.built:
        if (building.needs_build(model) or not model.trainable_variables
                or not building.settings_of(model).accum_steps_given):
            return []
        building.build_accumulation(model)  # zeros: a file always restores a clean window
    return [v.numpy() for v in model.accumulation.variables_for_saving()]


def restore(model, values: list) -> None:
    """Load saved accumulation-state ``values`` into ``model`` (building its state)."""
    if not model.trainable_variables:
        pending = saved_micro_step(values)
        if pending:
            raise ValueError(
                f"The saved accumulation state holds a partial window of {pending} "
                "micro-batch(es), but this model has no trainable variables to apply it "
                "to: unfreeze the model before loading, or save after `flush()`."
            )
        return  # an empty window: nothing to restore into a frozen model
    if model.optimizer is not None:
        check_optimizer(model.optimizer)
    with model.distribute_strategy.scope():
        entry.prepare(model.accumulation, model)
    variables = model.accumulation.variables_for_saving()
    if len(values) != len(variables):
        raise ValueError(
            f"Saved accumulation state has {len(values)} entries, this model needs "
            f"{len(variables)}: the file was saved from a different architecture (or with "
            "a different set of trainable variables)."
        )
    for v, value in zip(variables, values, strict=True):
        v.assign(value)
