"""The (dp, sp) mesh: the one dp * sp == world check, mesh_param, and the rank grid's groups."""

import pytest
import torch
import torch.distributed as dist

from ds_ulysses import Mesh, build_mesh
from ds_ulysses.config import UlyssesConfig
from ds_ulysses.distributed.mesh import check_mesh_param, mesh_shape
from tests.support.distributed import run_distributed


def test_dp_is_inferred_from_the_world_size():
    assert mesh_shape(16, 4) == (4, 4)
    assert mesh_shape(4) == (4, 1)
    section = UlyssesConfig.from_dict({"mesh_param": [3, 2]})
    assert mesh_shape(6, section.sp, section.mesh_param) == (3, 2)


@pytest.mark.parametrize("sp,mesh_param,world,numbers", [
    (4, None, 6, ["sp=4", "world_size=6", "6/4 = 1.5", "[1, 2, 3, 6]"]),
    (None, [2, 4], 6, ["dp=2", "sp=4", "world_size=6"]),
    (None, [3, 2], 8, ["dp=3", "sp=2", "world_size=8", "[4, 2]"]),
    (4, [2, 2], 4, ["sequence_parallel_size=4", "[2, 2]"]),
])
def test_a_world_size_the_mesh_cannot_tile_is_refused(sp, mesh_param, world, numbers):
    with pytest.raises(ValueError) as info:
        mesh_shape(world, sp, mesh_param)
    assert "expected" in str(info.value) and "fix:" in str(info.value)
    for number in numbers:
        assert number in str(info.value)


@pytest.mark.parametrize("world", [0, -2, 2.0, True, "8"])
def test_a_non_positive_int_world_size_is_refused(world):
    with pytest.raises(ValueError, match="world_size to be a positive integer"):
        mesh_shape(world, 1)


def test_sp_not_dividing_the_world_size_is_refused_by_build_mesh():
    with pytest.raises(ValueError, match="expected sp to divide world_size, got sp=3 and world_size=1"):
        build_mesh(3)


@pytest.mark.parametrize("value", [[2], "22", [0, 2], [True, 1], (2, 2.0), None])
def test_bad_mesh_param_is_refused(value):
    with pytest.raises(ValueError, match=r"mesh_param: expected \[dp, sp\], two integers >= 1"):
        check_mesh_param(value)
    if value is not None:
        with pytest.raises(ValueError, match=r"mesh_param: expected \[dp, sp\]"):
            build_mesh(mesh_param=value)


def _groups(rank, world_size):
    mesh = Mesh(2, 2)
    return {"sp": dist.get_process_group_ranks(mesh.sp_group), "dp": dist.get_process_group_ranks(mesh.dp_group),
            "ranks": (mesh.dp_rank, mesh.sp_rank), "mpu": (mesh.get_data_parallel_world_size(),
                                                           mesh.get_sequence_parallel_world_size(),
                                                           mesh.get_sequence_data_parallel_world_size()),
            "model": [dist.get_process_group_ranks(get()) for get in (
                mesh.get_model_parallel_group, mesh.get_tensor_model_parallel_group,
                mesh.get_pipeline_model_parallel_group)]}


def test_sp_groups_are_contiguous_rows_and_dp_groups_columns_of_the_rank_grid():
    results = run_distributed(_groups, 4)
    for rank, res in enumerate(results):
        row, col = divmod(rank, 2)
        assert res["sp"] == [2 * row, 2 * row + 1] and res["dp"] == [col, col + 2]
        assert res["ranks"] == (row, col) and res["mpu"] == (2, 2, 4)
        # no model parallelism: this rank alone (DeepSpeed sums gradient norms over it; None is the world)
        assert res["model"] == [[rank]] * 3


def _meshes_share_groups(rank, world_size, store_path):
    first, second = Mesh(1, 2), build_mesh(2)
    shared = [first.sp_group is second.sp_group, first.dp_group is second.dp_group,
              first.own_group is second.own_group]
    other_timeout = Mesh(1, 2, timeout_seconds=30).sp_group is not first.sp_group
    # a new world (destroy, then init again) gets new groups that work, not the dead world's
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    renewed = Mesh(1, 2)
    total = torch.ones(1)
    dist.all_reduce(total, group=renewed.sp_group)
    return {"shared": shared, "other_timeout": other_timeout, "renewed": renewed.sp_group is not first.sp_group,
            "sum": total.item()}


def test_meshes_of_one_world_share_their_process_groups(tmp_path):
    # torch keeps every group until the world goes: a new set per setup piled up groups and gloo threads
    for res in run_distributed(_meshes_share_groups, 2, str(tmp_path / "store")):
        assert res == {"shared": [True] * 3, "other_timeout": True, "renewed": True, "sum": 2.0}


def _ring_groups(rank, world_size, dp, sp, ring):
    mesh = Mesh(dp, sp, ring_size=ring)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=mesh.ring_group)
    return {"sp": dist.get_process_group_ranks(mesh.sp_group), "dp": dist.get_process_group_ranks(mesh.dp_group),
            "ulysses": dist.get_process_group_ranks(mesh.ulysses_group), "ring": mesh.ring_ranks,
            "ring_group": dist.get_process_group_ranks(mesh.ring_group), "ring_sum": total.item(),
            "ranks": (mesh.dp_rank, mesh.sp_rank, mesh.ring_rank, mesh.ulysses_rank),
            "mpu": (mesh.get_data_parallel_world_size(), mesh.get_sequence_parallel_world_size(),
                    mesh.get_sequence_data_parallel_world_size(), mesh.get_sequence_parallel_rank())}


@pytest.mark.slow
@pytest.mark.parametrize("dp,sp,ring,ulysses,rings", [
    (1, 4, 2, [[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]),
    (1, 4, 4, [[0], [1], [2], [3]], [[0, 1, 2, 3]] * 4),
    (2, 2, 2, [[0], [1], [2], [3]], [[0, 1], [0, 1], [2, 3], [2, 3]])])
def test_the_ring_runs_across_contiguous_ulysses_blocks_inside_each_sp_row(dp, sp, ring, ulysses, rings):
    results = run_distributed(_ring_groups, 4, dp, sp, ring)
    for rank, res in enumerate(results):
        row, sp_rank = divmod(rank, sp)
        u = sp // ring
        assert res["sp"] == list(range(row * sp, (row + 1) * sp))  # the SP group keeps its meaning
        assert res["dp"] == list(range(sp_rank, 4, sp))
        assert res["ulysses"] == ulysses[rank] and res["ring"] == res["ring_group"] == rings[rank]
        assert res["ring_sum"] == sum(res["ring"])
        assert res["ranks"] == (row, sp_rank, sp_rank // u, sp_rank % u)
        assert res["mpu"] == (dp, sp, 4, sp_rank)


@pytest.mark.parametrize("ring", [3, 0, True])
def test_a_ring_that_does_not_divide_sp_is_refused(ring):
    with pytest.raises(ValueError, match=r"ring_size: expected a divisor of sp=1"):
        Mesh(1, 1, ring_size=ring)
