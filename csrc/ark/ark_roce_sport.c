// ARK RoCE source ports: set the UDP source port of a RoCE v2 queue pair the plugin owns,
// through rdma-core's mlx5dv_modify_qp_udp_sport (mlx5 devices). The switch hashes that port
// like a TCP source port, so a planned port picks the QP's spine. UCX/NIXL never expose their
// ibv_qp, so this applies only to QPs created by our own transport.
//
// Built with rdma-core headers (infiniband/mlx5dv.h) when they exist; without them the
// argument checks still build and ark_roce_set_sport returns -ENOSYS.
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__has_include)
#if __has_include(<infiniband/mlx5dv.h>)
#include <infiniband/mlx5dv.h>
#define ARK_HAVE_MLX5DV 1
#endif
#endif

// 1 when compiled against rdma-core's mlx5dv, else 0
int ark_roce_has_mlx5dv(void) {
#ifdef ARK_HAVE_MLX5DV
  return 1;
#else
  return 0;
#endif
}

// 0 when sport is a usable RoCE v2 UDP source port (1..65535, not 4791, RoCE's destination
// port), else -EINVAL
int ark_roce_check_sport(int sport) {
  if (sport < 1 || sport > 65535 || sport == 4791) return -EINVAL;
  return 0;
}

// Set qp's UDP source port; 0, -EINVAL (no qp, bad port), -ENOSYS (built without mlx5dv),
// or the negative errno rdma-core reports (e.g. -EOPNOTSUPP on a non-mlx5 device).
int ark_roce_set_sport(void *qp, int sport) {
  if (qp == NULL) return -EINVAL;
  int rc = ark_roce_check_sport(sport);
  if (rc) return rc;
#ifdef ARK_HAVE_MLX5DV
  rc = mlx5dv_modify_qp_udp_sport((struct ibv_qp *)qp, (uint16_t)sport);
  return rc > 0 ? -rc : rc;
#else
  return -ENOSYS;
#endif
}
