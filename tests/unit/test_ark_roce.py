"""ARK's RoCE source-port extension, built from csrc/: argument checks here; setting a
real QP's port needs an mlx5 RDMA device and rdma-core (neither is on this machine)."""

from __future__ import annotations

import errno
import shutil

import pytest

from vllm_ext.ark.roce import HEADER, RoceError, has_mlx5dv, load, set_udp_sport

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler"),
]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return load(tmp_path_factory.mktemp("roce"))


def test_builds_with_mlx5dv_exactly_when_rdma_core_headers_exist(lib):
    assert has_mlx5dv(lib) == HEADER.is_file()


@pytest.mark.parametrize("sport", [0, -1, 65536, 4791, 10**6])
def test_bad_ports_are_refused(lib, sport):
    assert lib.ark_roce_check_sport(sport) == -errno.EINVAL
    with pytest.raises(RoceError) as err:
        set_udp_sport(lib, 0x1000, sport)
    assert err.value.errno == errno.EINVAL


@pytest.mark.parametrize("sport", [1, 49152, 0xC000 | 7, 65535])
def test_good_ports_pass_the_check(lib, sport):
    assert lib.ark_roce_check_sport(sport) == 0


def test_no_qp_is_refused_before_any_device_call(lib):
    with pytest.raises(RoceError) as err:
        set_udp_sport(lib, None, 49152)
    assert err.value.errno == errno.EINVAL


@pytest.mark.skipif(HEADER.is_file(), reason="rdma-core headers present: the call is real")
def test_without_rdma_core_setting_a_port_says_enosys(lib):
    with pytest.raises(RoceError) as err:
        set_udp_sport(lib, 0x1000, 49152)  # never dereferenced without mlx5dv
    assert err.value.errno == errno.ENOSYS
