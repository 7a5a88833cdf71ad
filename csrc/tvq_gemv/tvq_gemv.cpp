// TVQ fused lookup-GEMV for CPU decode: y[t, r] = scale[r] * sum_g <x[t, g], C[s(r), codes[r, g]]>.
//
// Per token and shard, the dot products of every input group with every codeword form a
// table [G, K] (in*K multiply-adds, it stays in cache); each output row then sums G table
// entries picked by its codes. The weight is read as codes only (log2 K bits per D weights),
// which is what makes memory-bound decode faster than a bf16 GEMV.
// The CUDA version, when written, goes in tvq_gemv_cuda.cu with its own TORCH_LIBRARY_IMPL.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <vector>

namespace {

template <typename code_t>
void rows_from_table(const float* table, const code_t* codes, const float* scale, float* out,
                     int64_t groups, int64_t num_codewords, int64_t lo, int64_t hi) {
  for (int64_t r = lo; r < hi; ++r) {
    const code_t* c = codes + r * groups;
    float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f, acc3 = 0.f;
    int64_t g = 0;
    for (; g + 4 <= groups; g += 4) {
      acc0 += table[(g + 0) * num_codewords + c[g + 0]];
      acc1 += table[(g + 1) * num_codewords + c[g + 1]];
      acc2 += table[(g + 2) * num_codewords + c[g + 2]];
      acc3 += table[(g + 3) * num_codewords + c[g + 3]];
    }
    for (; g < groups; ++g) acc0 += table[g * num_codewords + c[g]];
    out[r] = (acc0 + acc1 + acc2 + acc3) * scale[r];
  }
}

void build_table(const float* x, const float* codebook, float* table, int64_t groups,
                 int64_t num_codewords, int64_t dim) {
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const float* xg = x + g * dim;
      float* tg = table + g * num_codewords;
      for (int64_t k = 0; k < num_codewords; ++k) {
        const float* ck = codebook + k * dim;
        float acc = 0.f;
        for (int64_t d = 0; d < dim; ++d) acc += xg[d] * ck[d];
        tg[k] = acc;
      }
    }
  });
}

}  // namespace

at::Tensor tvq_gemv_cpu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& codebook,
                        const at::Tensor& scale, const at::Tensor& shard_rows) {
  TORCH_CHECK(x.dim() == 2, "tvq_gemv: x must be [T, in], got ", x.sizes());
  TORCH_CHECK(codes.dim() == 2, "tvq_gemv: codes must be [rows, G], got ", codes.sizes());
  TORCH_CHECK(codebook.dim() == 3, "tvq_gemv: codebook must be [S, K, D], got ", codebook.sizes());
  TORCH_CHECK(codes.scalar_type() == at::kByte || codes.scalar_type() == at::kInt,
              "tvq_gemv: codes must be uint8 or int32");
  const int64_t rows = codes.size(0), groups = codes.size(1);
  const int64_t shards = codebook.size(0), num_codewords = codebook.size(1), dim = codebook.size(2);
  TORCH_CHECK(x.size(1) == groups * dim, "tvq_gemv: x has ", x.size(1), " columns, codes need ",
              groups * dim);
  TORCH_CHECK(scale.numel() == rows, "tvq_gemv: scale must have one value per row");
  TORCH_CHECK(shard_rows.numel() == shards + 1, "tvq_gemv: shard_rows must be [S + 1]");
  TORCH_CHECK(codes.scalar_type() != at::kByte || num_codewords <= 256,
              "tvq_gemv: uint8 codes need K <= 256");

  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor cbf = codebook.to(at::kFloat).contiguous();
  const at::Tensor sf = scale.to(at::kFloat).contiguous().view({rows});
  const at::Tensor cc = codes.contiguous();
  const at::Tensor bounds = shard_rows.to(at::kLong).contiguous();
  const int64_t* b = bounds.data_ptr<int64_t>();
  TORCH_CHECK(b[0] == 0 && b[shards] == rows, "tvq_gemv: shard_rows must run from 0 to rows");
  at::Tensor out = at::empty({x.size(0), rows}, xf.options());
  std::vector<float> table(groups * num_codewords);

  for (int64_t t = 0; t < x.size(0); ++t) {
    float* yt = out.data_ptr<float>() + t * rows;
    for (int64_t s = 0; s < shards; ++s) {
      build_table(xf.data_ptr<float>() + t * x.size(1),
                  cbf.data_ptr<float>() + s * num_codewords * dim, table.data(), groups,
                  num_codewords, dim);
      at::parallel_for(b[s], b[s + 1], 64, [&](int64_t lo, int64_t hi) {
        if (cc.scalar_type() == at::kByte) {
          rows_from_table(table.data(), cc.data_ptr<uint8_t>(), sf.data_ptr<float>(), yt, groups,
                          num_codewords, lo, hi);
        } else {
          rows_from_table(table.data(), cc.data_ptr<int32_t>(), sf.data_ptr<float>(), yt, groups,
                          num_codewords, lo, hi);
        }
      });
    }
  }
  return out.to(x.scalar_type());
}

TORCH_LIBRARY(vllm_ext_tvq, m) {
  m.def("tvq_gemv(Tensor x, Tensor codes, Tensor codebook, Tensor scale, Tensor shard_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_ext_tvq, CPU, m) { m.impl("tvq_gemv", &tvq_gemv_cpu); }
