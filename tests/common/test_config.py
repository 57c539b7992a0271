from dataclasses import dataclass
from typing import Literal

import pytest

from backend_lib.config import ConfigError, from_parameters, require, triton_parameters
from backend_lib.llm.config import LLMConfig


@dataclass
class Example:
    count: int = 1
    ratio: float = 0.5
    flag: bool = False
    name: str = "x"
    mode: Literal["a", "b"] = "a"
    limit: int | None = None

    def validate(self) -> None:
        require(self.count >= 1, "count", self.count, "must be >= 1")


def test_values_convert_by_annotation():
    config = from_parameters(
        Example,
        {"count": "3", "ratio": "0.25", "flag": "TRUE", "name": "y", "mode": "b", "limit": "7"},
    )
    assert config == Example(3, 0.25, True, "y", "b", 7)
    assert from_parameters(Example, {"flag": "off", "limit": ""}) == Example(flag=False)


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("count", "three", "expected an integer"),
        ("ratio", "nan", "finite"),
        ("flag", "maybe", "expected a boolean"),
        ("mode", "c", "expected one of a, b"),
        ("count", "0", "must be >= 1"),
        ("colour", "red", "unknown parameter"),
    ],
)
def test_errors_name_key_and_value(key, value, fragment):
    with pytest.raises(ConfigError) as info:
        from_parameters(Example, {key: value})
    message = str(info.value)
    assert f"'{key}'" in message and str(value) in message and fragment in message


def test_triton_parameters_flatten_model_config():
    model_config = (
        '{"parameters": {"model": {"string_value": "/m"}, "dtype": {"string_value": "float32"}}}'
    )
    assert triton_parameters(model_config) == {"model": "/m", "dtype": "float32"}
    assert triton_parameters({}) == {}


def test_llm_config_validation_names_field():
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        from_parameters(LLMConfig, {"tensor_parallel_size": "0"})
    with pytest.raises(ConfigError, match="pipeline_parallel_size.*must be >= 1"):
        from_parameters(LLMConfig, {"pipeline_parallel_size": "0"})
    with pytest.raises(ConfigError, match="nnodes"):
        from_parameters(LLMConfig, {"tensor_parallel_size": "3", "nnodes": "2"})
    with pytest.raises(ConfigError, match=r"nnodes.*pipeline_parallel_size \(6\)"):
        params = {"tensor_parallel_size": "3", "pipeline_parallel_size": "2", "nnodes": "4"}
        from_parameters(LLMConfig, params)
    assert (
        from_parameters(
            LLMConfig, {"tensor_parallel_size": "3", "pipeline_parallel_size": "2"}
        ).world_size
        == 6
    )
    with pytest.raises(ConfigError, match="master_port"):
        from_parameters(LLMConfig, {"tensor_parallel_size": "2", "nnodes": "2"})
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        from_parameters(LLMConfig, {"gpu_memory_utilization": "1.5"})
    config = from_parameters(LLMConfig, {"max_num_seqs": "8", "enable_prefix_caching": "false"})
    assert config.max_num_seqs == 8 and config.enable_prefix_caching is False
