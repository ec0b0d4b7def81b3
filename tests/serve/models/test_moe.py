"""layers.MoE against transformers' own mixture-of-experts modules (DeepSeek-V2's softmax routing,
greedy and group-limited; DeepSeek-V3's sigmoid routing with groups and a score bias; each with
its shared experts), their weights copied in: the same outputs in float32; and a DeepSeek model
with experts from layer first_k_dense_replace on served by the Engine gives its dense forward's
greedy tokens."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from jaxattn.serve.models import layers
from tests.conftest import require_parity
from tests.paged_inputs import rel_error

DIM, EXPERTS, HIDDEN = 32, 8, 16


@dataclasses.dataclass(frozen=True)
class _Config:
    """The fields layers.MoE reads."""
    dim: int = DIM
    num_experts: int = EXPERTS
    num_experts_per_tok: int = 3
    moe_hidden_dim: int = HIDDEN
    norm_topk_prob: bool = False
    shared_expert_dim: int = 2 * HIDDEN
    hidden_dim: int = 0
    dtype: str = "float32"
    routing: layers.MoERouting = layers.MoERouting(gated_shared_expert=False)


CASES = {
    "v2-greedy": ("DeepseekV2", dict(topk_method="greedy", routed_scaling_factor=1.0),
                  layers.MoERouting(gated_shared_expert=False), False),
    "v2-group-limited": ("DeepseekV2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                            routed_scaling_factor=2.5),
                         layers.MoERouting(n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                           gated_shared_expert=False), False),
    "v3-sigmoid-bias": ("DeepseekV3", dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True),
                        layers.MoERouting(scoring="sigmoid", n_group=4, topk_group=2, score_bias=True,
                                          routed_scaling_factor=2.5, gated_shared_expert=False), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_matches_transformers_deepseek(case):
    transformers = require_parity()
    import torch

    family, changes, routing, norm = CASES[case]
    config = getattr(transformers, f"{family}Config")(
        hidden_size=DIM, intermediate_size=64, moe_intermediate_size=HIDDEN, n_routed_experts=EXPERTS,
        num_experts_per_tok=3, n_shared_experts=2, num_hidden_layers=1, num_attention_heads=2, vocab_size=16,
        **changes)
    modeling = importlib.import_module(f"transformers.models.{family.lower().replace('deepseekv', 'deepseek_v')}"
                                       f".modeling_{family.lower().replace('deepseekv', 'deepseek_v')}")
    module_class = getattr(modeling, f"{family}MoE" if family == "DeepseekV3" else f"{family}Moe")
    torch.manual_seed(0)
    reference = module_class(config).to(torch.float32).eval()
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.normal_(0, 0.3)
        if family == "DeepseekV3":
            reference.gate.e_score_correction_bias.normal_(0, 0.1)
    moe = layers.MoE(_Config(norm_topk_prob=norm, routing=routing), nnx.Rngs(0))
    experts = reference.experts
    gate_up = experts.gate_up_proj.detach().numpy()                  # [E, 2F, dim]
    moe.router.kernel.set_value(jnp.asarray(reference.gate.weight.detach().numpy().T))
    moe.gate_proj.set_value(jnp.asarray(gate_up[:, :HIDDEN].transpose(0, 2, 1)))
    moe.up_proj.set_value(jnp.asarray(gate_up[:, HIDDEN:].transpose(0, 2, 1)))
    moe.down_proj.set_value(jnp.asarray(experts.down_proj.detach().numpy().transpose(0, 2, 1)))
    if routing.score_bias:
        moe.score_bias.set_value(jnp.asarray(reference.gate.e_score_correction_bias.detach().numpy()))
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(moe.shared_expert, name).kernel.set_value(
            jnp.asarray(getattr(reference.shared_experts, name).weight.detach().numpy().T))
    x = np.random.default_rng().normal(size=(11, DIM)).astype(np.float32)
    with torch.no_grad():
        expected = reference(torch.from_numpy(x)[None])[0].numpy()
    assert rel_error(moe(jnp.asarray(x)), expected) < 1e-5


def test_deepseek_with_experts_serves_its_greedy_tokens():
    from jaxattn.serve.engine import Engine
    from jaxattn.serve.models.deepseek import PRESETS, DeepSeek
    from tests.serve.models.test_deepseek import dense_greedy

    cfg = PRESETS["tiny"].replace(num_experts=6, num_experts_per_tok=2, moe_hidden_dim=32, shared_expert_dim=64,
                                  first_k_dense_replace=1, routing=layers.MoERouting(
                                      scoring="sigmoid", n_group=2, topk_group=1, score_bias=True,
                                      routed_scaling_factor=1.5, gated_shared_expert=False))
    model = DeepSeek(cfg, nnx.Rngs(0))
    assert [type(block.mlp).__name__ for block in model.layers] == ["MLP", "MoE"]
    rng = np.random.default_rng()
    prompts = [rng.integers(0, cfg.vocab_size, size=n) for n in (4, 19)]
    engine = Engine(model, max_seqs=2, max_seq_len=40, page_size=8, max_step_tokens=16, backend="xla")
    requests = [engine.add_request(p, 6) for p in prompts]
    engine.run()
    assert [r.output for r in requests] == [dense_greedy(model, p, 6) for p in prompts]


@pytest.mark.parametrize("changes, match", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok must be in \\[1, num_experts=8\\]"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok must be in"),
    (dict(moe_hidden_dim=0), "moe_hidden_dim must be >= 1"),
    (dict(routing=layers.MoERouting(n_group=3, topk_group=1)), "must split into routing.n_group=3"),
    (dict(routing=layers.MoERouting(scoring="sigmoid", n_group=8, topk_group=2)), "groups of at least 2"),
])
def test_bad_moe_configs_are_named(changes, match):
    with pytest.raises(ValueError, match=match):
        layers.MoE(dataclasses.replace(_Config(), **changes), nnx.Rngs(0))


@pytest.mark.parametrize("kwargs, match", [
    (dict(scoring="relu"), "scoring must be 'softmax' or 'sigmoid'"),
    (dict(n_group=2, topk_group=3), "1 <= topk_group <= n_group"),
    (dict(n_group=0, topk_group=0), "1 <= topk_group <= n_group"),
])
def test_bad_routing_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        layers.MoERouting(**kwargs)


def test_experts_split_over_devices_sum_to_the_whole():
    """routed_experts over each half of the experts (``first``: a device's first expert) adds up
    to routed_experts over all of them: what each device of expert parallelism computes."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(11, DIM)), jnp.float32)
    weights = jnp.asarray(rng.uniform(size=(11, 3)), jnp.float32)
    chosen = jnp.asarray(np.stack([rng.choice(EXPERTS, 3, replace=False) for _ in range(11)]), jnp.int32)
    experts = [jnp.asarray(rng.normal(size=shape), jnp.float32) * 0.3
               for shape in ((EXPERTS, DIM, HIDDEN), (EXPERTS, DIM, HIDDEN), (EXPERTS, HIDDEN, DIM))]
    whole = layers.routed_experts(x, weights, chosen, *experts)
    half = EXPERTS // 2
    parts = [layers.routed_experts(x, weights, chosen, *[w[first:first + half] for w in experts], first=first)
             for first in (0, half)]
    assert rel_error(parts[0] + parts[1], whole) < 1e-6
    dense = sum(weights[:, j, None] * jnp.stack([
        (jax.nn.silu(x[t] @ experts[0][e]) * (x[t] @ experts[1][e])) @ experts[2][e]
        for t, e in enumerate(np.asarray(chosen[:, j]))]) for j in range(3))
    assert rel_error(whole, dense) < 1e-5


def check_tensor_parallel_experts_run_on_their_slices() -> None:
    """(On 2 CPU devices.) Experts split by hidden units (``layers.ExpertTensorParallel``, what
    ``shard_model`` sets without expert parallelism) give the one-device output with every
    strategy, bf16-free float32 stacks and FP8 ones (per channel each kernel transposed, blocks):
    each device computes on its own slices and one all-reduce adds them, with no gather of expert
    weights (under plain jit, the Triton grouped GEMM, a custom call, had them all gathered). The
    Triton strategy is compiled, not run: its interpreter cannot run on two devices at once; the
    one-device tests and the GPU check its numbers."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxattn.serve.models.experts import GEMMS, Fp8Stack
    from jaxattn.serve.models.quantization import quantize_stack
    from tests.serve.models.test_experts import expert_weights, routing
    from tests.serve.test_engine import _communicated

    mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    split = layers.ExpertTensorParallel(mesh, "tp")
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(11, DIM)), jnp.float32)
    weights, chosen = map(jnp.asarray, routing(rng, 11, EXPERTS, 3))
    arrays = expert_weights(rng, EXPERTS, DIM, 64)      # 32 hidden units per device: FP8 tiles at least 32 deep
    fp8 = {granularity: [Fp8Stack(*quantize_stack(np.swapaxes(w, 1, 2), granularity, layout="enk"),
                                  None if granularity == "channel" else granularity, "enk") for w in arrays]
           for granularity in ("channel", (16, 16))}
    for name, stacks in (("float32", [jnp.asarray(w) for w in arrays]), *(("fp8", s) for s in fp8.values())):
        placed = [jax.device_put(stack, jax.tree.map(lambda spec: NamedSharding(mesh, spec), split.spec(key, stack),
                                                     is_leaf=lambda leaf: isinstance(leaf, PartitionSpec)))
                  for key, stack in zip(layers.EXPERT_AXES, stacks)]
        for gemm in GEMMS:
            run = jax.jit(lambda *a, gemm=gemm: split(*a, gemm=gemm))
            sizes = _communicated(run.lower(x, weights, chosen, *placed).compile().as_text())
            assert set(sizes) == {"all-reduce"}, (name, gemm, sizes)
            if gemm == "triton":     # compiled only: Triton's interpreter runs one kernel at a time, not per device
                continue
            whole = jax.jit(lambda *a, gemm=gemm: layers.routed_experts(*a, gemm=gemm))(x, weights, chosen, *stacks)
            assert rel_error(run(x, weights, chosen, *placed), whole) < 1e-5, (name, gemm)


def test_tensor_parallel_experts_on_two_cpu_devices():
    from tests.test_sharding import run_on_cpu_devices

    run_on_cpu_devices(2, "from tests.serve.models.test_moe import check_tensor_parallel_experts_run_on_their_slices; "
                          "check_tensor_parallel_experts_run_on_their_slices()")


def moe_llama():
    from jaxattn.serve.models.llama import PRESETS, Llama

    cfg = PRESETS["tiny"].replace(num_experts=4, num_experts_per_tok=2, moe_hidden_dim=48, shared_expert_dim=32,
                                  dtype="float32")
    return Llama(cfg, nnx.Rngs(0))


def _served(model) -> tuple[list[np.ndarray], Mesh, Callable]:
    """(prompts, a 2-device mesh, ``engine(mesh=None)``: a small xla Engine of ``model``)."""
    from jaxattn.serve.engine import Engine

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.cfg.vocab_size, size=n) for n in (5, 21, 1, 13)]

    def engine(mesh=None) -> Engine:
        return Engine(model, max_seqs=3, max_seq_len=40, page_size=8, max_step_tokens=16, backend="xla", mesh=mesh)

    return prompts, jax.make_mesh((2,), ("tp",)), engine


def check_moe_engine_on_mesh() -> None:
    """(On 2 CPU devices.) A Qwen2-MoE-shaped model (shared expert, float32) served on a mesh gives
    the one-device engine's greedy tokens, its experts split by hidden columns (tensor
    parallelism) or whole per device (``enable_expert_parallel``); expert-parallel steps keep
    each device's experts where they are (no gather of expert weights, an all-reduce per layer's
    experts) and ``shard_model`` places half the experts on each device, FP8 experts' scales
    with their values; shards that do not divide the experts (or their hidden columns) are named."""
    from jaxattn.serve.models.llama import Llama, enable_expert_parallel, shard_model
    from jaxattn.serve.models.quantization import quantize
    from tests.serve.test_engine import _communicated, _greedy_outputs
    from tests.serve.test_step import trace_step

    model = moe_llama()
    cfg = model.cfg
    prompts, mesh, engine = _served(model)
    expected = _greedy_outputs(engine(), prompts, 6)
    assert model.layers[0].mlp.tensor_parallel is None
    assert _greedy_outputs(engine(mesh), prompts, 6) == expected
    assert isinstance(model.layers[0].mlp.tensor_parallel, layers.ExpertTensorParallel)     # Engine(mesh=) set it
    enable_expert_parallel(model, mesh)
    parallel = engine(mesh)
    assert model.layers[0].mlp.tensor_parallel is None
    assert _greedy_outputs(parallel, prompts, 6) == expected
    expert_bytes = cfg.dim * cfg.moe_hidden_dim            # one expert's gate_proj, in elements
    for shape in (parallel.buckets.shapes[0], parallel.buckets.shapes[-1]):
        sizes = _communicated(trace_step(parallel, shape).lower().compile().as_text())
        assert len(sizes.pop("all-reduce", [])) >= 2 * cfg.num_layers, (shape, sizes)
        assert set(sizes) <= {"all-gather"} and max(sizes.get("all-gather", [0])) < expert_bytes, (shape, sizes)
    sharded = shard_model(moe_llama(), mesh, expert_parallel=True)
    gate = sharded.layers[0].mlp.gate_proj[...]
    assert gate.addressable_shards[0].data.shape == (cfg.num_experts // 2, cfg.dim, cfg.moe_hidden_dim)
    # FP8 experts (values and scales split alike): one device's greedy tokens, TP and EP
    expected = _greedy_outputs(_served(quantize(moe_llama()))[2](), prompts, 6)
    for expert_parallel in (False, True):
        placed = shard_model(quantize(moe_llama()), mesh, expert_parallel=expert_parallel)
        scale = placed.layers[0].mlp.gate_proj.scale.get_value()
        assert scale.addressable_shards[0].data.shape == ((cfg.num_experts // 2, cfg.moe_hidden_dim) if expert_parallel
                                                          else (cfg.num_experts, cfg.moe_hidden_dim // 2))
        assert _greedy_outputs(_served(placed)[2](mesh), prompts, 6) == expected
    odd = Llama(cfg.replace(num_experts=3, moe_hidden_dim=47), nnx.Rngs(0))
    with pytest.raises(ValueError, match="expert parallelism over 2 shards .* num_experts \\(3\\) must be a multiple"):
        enable_expert_parallel(odd, mesh)
    with pytest.raises(ValueError, match="tensor parallelism over 2 shards .* moe_hidden_dim \\(47\\) must be a"):
        shard_model(odd, mesh)


def test_moe_engine_on_two_cpu_devices():
    from tests.test_sharding import run_on_cpu_devices

    run_on_cpu_devices(2, "from tests.serve.models.test_moe import check_moe_engine_on_mesh; "
                          "check_moe_engine_on_mesh()")


def moe_deepseek():
    from jaxattn.serve.models.deepseek import PRESETS, DeepSeek

    cfg = PRESETS["tiny"].replace(num_experts=4, num_experts_per_tok=2, moe_hidden_dim=32, shared_expert_dim=64,
                                  first_k_dense_replace=1, dtype="float32",
                                  routing=layers.MoERouting(scoring="sigmoid", n_group=2, topk_group=1,
                                                            score_bias=True, gated_shared_expert=False))
    return DeepSeek(cfg, nnx.Rngs(0))


def check_deepseek_engine_on_mesh() -> None:
    """(On 2 CPU devices.) A DeepSeek with a dense first layer and experts after, served on a mesh,
    gives the one-device engine's greedy tokens with its experts split by hidden columns and
    whole per device; its MLA weights and latent pools stay whole on each device, its MLPs and
    experts are split."""
    from jaxattn.serve.models.parallel import enable_expert_parallel, shard_model
    from tests.serve.test_engine import _greedy_outputs

    model = moe_deepseek()
    cfg = model.cfg
    prompts, mesh, engine = _served(model)
    expected = _greedy_outputs(engine(), prompts, 6)
    tensor_parallel = engine(mesh)
    pool = tensor_parallel.runner.caches[0].pages
    assert pool.sharding.is_fully_replicated and pool.addressable_shards[0].data.shape == pool.shape
    assert _greedy_outputs(tensor_parallel, prompts, 6) == expected
    enable_expert_parallel(model, mesh)
    assert _greedy_outputs(engine(mesh), prompts, 6) == expected
    sharded = shard_model(moe_deepseek(), mesh, expert_parallel=True)
    moe, attention = sharded.layers[1].mlp, sharded.layers[1].attn
    assert moe.gate_proj[...].addressable_shards[0].data.shape == (cfg.num_experts // 2, cfg.dim, cfg.moe_hidden_dim)
    kv_b = attention.kv_b_proj.kernel[...]
    assert kv_b.addressable_shards[0].data.shape == kv_b.shape
    dense = sharded.layers[0].mlp.gate_proj.kernel[...]
    assert dense.addressable_shards[0].data.shape == (cfg.dim, cfg.hidden_dim // 2)


def test_deepseek_engine_on_two_cpu_devices():
    from tests.test_sharding import run_on_cpu_devices

    run_on_cpu_devices(2, "from tests.serve.models.test_moe import check_deepseek_engine_on_mesh; "
                          "check_deepseek_engine_on_mesh()")


def test_expert_parallel_errors_name_the_field():
    from jaxattn.serve.models.llama import PRESETS, Llama, enable_expert_parallel, param_shardings

    model = moe_llama()
    mesh = jax.make_mesh((1,), ("tp",))
    with pytest.raises(ValueError, match="the model has no experts"):
        enable_expert_parallel(Llama(PRESETS["tiny"], nnx.Rngs(0)), mesh)
    enable_expert_parallel(model, mesh)
    other = jax.make_mesh((1,), ("ep",))
    with pytest.raises(ValueError, match="experts are split over mesh axes 'tp' of another mesh"):
        param_shardings(model, other)
