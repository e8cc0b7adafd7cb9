"""What a micro-step costs inside the graph, measured against Keras's own step.

The graph operations of the traced ``train_step`` (both branches of every
``cond``), against Keras's ``train_step`` with ``gradient_accumulation_steps`` on the same
model. Issue 19's target is "no more than Keras's"; today accumcore's has a per-micro-batch
NaN/Inf check (and its rarely taken freeze branch) that Keras does not, so the test holds the
measured gap as a ceiling: a change that adds operations to the hot path fails here.
"""

import keras
import tensorflow as tf

import accumcore
from accumcore.lab import benchmarking as bm

#: Graph operations accumcore's train_step may have beyond Keras's accumulating one (MLP,
#: Adam): 89 measured on Keras 3.15 and 3.10 on 2026-12-02 (516 vs 427 on 3.15).
OPS_OVER_KERAS_CEILING = 89


def test_train_step_graph_ops_stay_within_the_measured_gap_to_keras():
    x, y = bm.benchmark_data("mlp", 64, "synthetic")
    specs = ((tf.TensorSpec((None, *bm.INPUT_SHAPES["mlp"]), tf.float32),
              tf.TensorSpec((None,), tf.int32)),)

    def ops(model, optimizer):
        model.compile(optimizer, bm.LOSS, jit_compile=False)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        return bm.graph_op_count(tf.function(model.train_step).get_concrete_function(*specs))

    accum = ops(bm.build_model("mlp", model_cls=accumcore.AccumModel, accum_steps=4),
                keras.optimizers.Adam(1e-3))
    keras_ga = ops(bm.build_model("mlp"),
                   keras.optimizers.Adam(1e-3, gradient_accumulation_steps=4))
    assert accum - keras_ga <= OPS_OVER_KERAS_CEILING, (accum, keras_ga)
