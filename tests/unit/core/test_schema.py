"""The one adapter from a batch's column tensors to the model's arguments."""

from __future__ import annotations

import torch

from spark_torch_est.core.schema import FEATURES_LAYOUT, INPUTS_LAYOUT, InputColumn, InputSchema, call_model


def test_features_are_one_tensor_and_typed_inputs_a_tuple_reshaped_by_input_shapes():
    features = InputSchema(FEATURES_LAYOUT, (InputColumn("features", "float32", 1, "array<float>"),))
    x = torch.ones(4, 3)
    assert features.model_inputs([x]) is x
    typed = InputSchema(INPUTS_LAYOUT, (InputColumn("id", "int64", 0, "bigint"),
                                        InputColumn("image", "uint8", 1, "binary", shape=(1, 2, 2))))
    ids, image = typed.model_inputs([torch.arange(4), torch.zeros(4, 4, dtype=torch.uint8)])
    assert ids.shape == (4,) and image.shape == (4, 1, 2, 2) and image.dtype == torch.uint8
    assert call_model(lambda i, m: (i.shape, m.shape), (ids, image)) == ((4,), (4, 1, 2, 2))
    assert call_model(lambda f: f.sum(), x) == 12


def test_what_the_model_was_given_is_told_in_the_users_column_names():
    features = InputSchema(FEATURES_LAYOUT, (InputColumn("a, b", "float32", 1, "array<float>"),))
    assert features.describe([torch.ones(2, 2)], ["a", "b"]) == \
        "the model was given 2 features per row (featureCols ['a', 'b']): a batch of shape (2, 2)"
    typed = InputSchema(INPUTS_LAYOUT, (InputColumn("id", "int64", 0, "bigint"),))
    assert typed.describe([torch.arange(2)]) == "the model was called as model(*inputs) with inputCols 'id': int64 (2,)"
