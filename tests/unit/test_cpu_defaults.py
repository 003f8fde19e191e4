"""The CPU-specific defaults derived from the hardware in one place (`asyncrl.config.roles`):
vLLM's worker in-process and the rollout niced on CPU, nothing changed on GPU, each overridable."""

from asyncrl.config import Config, engine_env, rollout_cpu_nice


def test_cpu_engines_run_their_worker_in_process_unless_told_not_to():
    assert engine_env(0, None) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert engine_env(0, True) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert engine_env(0, False) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def test_gpu_engines_keep_vllms_own_choice():
    assert engine_env(1, None) == {}
    assert engine_env(4, True) == {}  # tensor parallelism needs the worker processes


def test_the_rollout_yields_the_cpu_to_the_learner_on_cpu_only():
    assert rollout_cpu_nice(0, None) == 19  # Ray's workers start at 15: only 16..19 yield to the learner
    assert rollout_cpu_nice(1, None) is None  # GPU: left as Ray started it
    assert rollout_cpu_nice(0, 0) == 0
    assert rollout_cpu_nice(2, 5) == 5


def test_the_config_fields_default_to_derived():
    cfg = Config()
    assert cfg.rollout.cpu_nice is None and cfg.rollout.engine_in_process is None
