// A whole decode step of a Llama / Qwen2 decoder stack in one call (included by
// quant_linear.cpp, whose weight-only kernels it runs): for a few token rows (decodes, and
// a sequence's last token with its drafts when speculation verifies them), every
// layer's RMSNorm, fused q/k/v projection, RoPE and key/value store, paged attention, output
// projection, SiLU-gated MLP and residual sums, on int8 / int4 weights.
//
// At one to a few rows a decode step is ~120 small matrix-vector products and as many small
// element-wise operations. Called one by one from Python, each costs its dispatch and its own
// fork/join of the thread team, which on a 135M model is a quarter of the step. Here the
// team is forked once per step: each thread computes its share of every product's output
// columns (the same columns, in the same order, as one qlinear call gives it), the
// element-wise work is done by every thread on its own copy, and a spinning barrier
// separates the stages. Every value is computed by the same inline code as the one-operation
// kernels, so both paths give the same bits.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "attention_kernels.h"

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// A sense-reversing barrier for the step's threads: they spin (a stage lasts microseconds),
// yielding after a while so a descheduled peer can run.
class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}
  void wait() {
    if (n_ == 1) return;
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      count_.store(0, std::memory_order_relaxed);
      gen_.store(gen + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; gen_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins < 20000) cpu_relax();
      else std::this_thread::yield();
    }
  }

 private:
  const int n_;
  std::atomic<int> count_{0};
  std::atomic<int> gen_{0};
};

struct QLin {
  torch::Tensor w, scales, mins, bias;
  int fmt = 0;  // 0 int8, 1 int4
  int act = 2;  // activation rows as int8 (1) or int16 (2)
  int64_t kp = 0, n = 0;
};

struct StackLayer {
  torch::Tensor norm1, norm2;
  float eps1 = 0.f, eps2 = 0.f;
  QLin qkv, o, gate_up, down;
};

// A thread's activation rows for lin's product (qlinear's prologue).
inline void prepare(Activations& rows, const float* x, int64_t m, const QLin& lin) {
  if (lin.fmt == 1) rows.sums(x, m, lin.kp);
  rows.quantize(x, m, lin.kp, lin.act);
}

// Output columns n0..n1 of lin over those rows into out [m, lin.n].
inline void product(const Activations& rows, const QLin& lin, int64_t m, bool simd, float* out,
                    int64_t n0, int64_t n1) {
  if (n0 >= n1) return;
  rows.product(lin.fmt, lin.act, simd, m, lin.kp, static_cast<const uint8_t*>(lin.w.data_ptr()),
               lin.scales.data_ptr<float>(), lin.fmt == 1 ? lin.mins.data_ptr<float>() : nullptr,
               lin.bias.numel() ? lin.bias.data_ptr<float>() : nullptr, out, lin.n, n0, n1);
}

// Thread tid's share of n output columns, in blocks of 16 (qlinear's split).
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int team) {
  const int64_t blocks = (n + 15) / 16;
  return {std::min(n, blocks * tid / team * 16), std::min(n, blocks * (tid + 1) / team * 16)};
}

}  // namespace

using rt_attn::AttendFn;

class DecodeStack {
 public:
  DecodeStack(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
              bool simd)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), dim_(head_dim),
        scale_(static_cast<float>(scale)), simd_(simd) {
    TORCH_CHECK(hidden > 0 && hidden % G == 0, "hidden: expected a multiple of 32, got ", hidden);
    TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0 && head_dim % 2 == 0,
                "heads, kv_heads, head_dim: expected heads a multiple of kv_heads, an even head size");
  }

  // A layer: its two norms' weights and epsilons, and q/k/v, o, gate/up and down as
  // (weight, scales, mins, bias) each with their format (0 int8, 1 int4) and activation rows
  // (1 int8, 2 int16).
  void add_layer(torch::Tensor norm1, double eps1, torch::Tensor norm2, double eps2,
                 std::vector<torch::Tensor> tensors, std::vector<int64_t> fmts,
                 std::vector<int64_t> acts) {
    TORCH_CHECK(tensors.size() == 16 && fmts.size() == 4 && acts.size() == 4,
                "add_layer: expected 16 tensors, 4 formats, 4 activation kinds");
    const int64_t q_width = heads_ * dim_, kv_width = kv_heads_ * dim_;
    StackLayer layer;
    layer.norm1 = norm1.contiguous();
    layer.norm2 = norm2.contiguous();
    layer.eps1 = static_cast<float>(eps1);
    layer.eps2 = static_cast<float>(eps2);
    QLin* lins[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int i = 0; i < 4; ++i) {
      QLin& lin = *lins[i];
      lin.w = tensors[4 * i];
      lin.scales = tensors[4 * i + 1];
      lin.mins = tensors[4 * i + 2];
      lin.bias = tensors[4 * i + 3];
      lin.fmt = static_cast<int>(fmts[i]);
      lin.act = static_cast<int>(acts[i]);
      TORCH_CHECK(lin.fmt == 0 || lin.fmt == 1, "add_layer: expected int8 or int4 weights");
      TORCH_CHECK(lin.act == 1 || lin.act == 2, "add_layer: expected int8 or int16 activations");
      TORCH_CHECK(lin.w.is_contiguous() && lin.w.dim() == 2, "add_layer: weight ", i,
                  ": expected contiguous [N, *]");
      lin.n = lin.w.size(0);
      lin.kp = lin.fmt == 1 ? 2 * lin.w.size(1) : lin.w.size(1);
      TORCH_CHECK(lin.scales.scalar_type() == torch::kFloat && lin.scales.is_contiguous() &&
                      lin.scales.numel() == lin.n * (lin.kp / G),
                  "add_layer: scales ", i, ": expected float32 [N, K / 32]");
      TORCH_CHECK(lin.fmt == 0 || (lin.mins.scalar_type() == torch::kFloat &&
                                   lin.mins.numel() == lin.n * (lin.kp / G)),
                  "add_layer: mins ", i, ": expected float32 [N, K / 32]");
      TORCH_CHECK(lin.bias.numel() == 0 || (lin.bias.scalar_type() == torch::kFloat &&
                                            lin.bias.numel() == lin.n),
                  "add_layer: bias ", i, ": expected float32 [N]");
    }
    TORCH_CHECK(layer.norm1.numel() == hidden_ && layer.norm2.numel() == hidden_,
                "add_layer: norms: expected ", hidden_, " weights");
    TORCH_CHECK(layer.qkv.kp == hidden_ && layer.qkv.n == q_width + 2 * kv_width,
                "add_layer: q/k/v: expected [", q_width + 2 * kv_width, ", ", hidden_, "]");
    TORCH_CHECK(layer.o.kp == q_width && layer.o.n == hidden_, "add_layer: o: expected [",
                hidden_, ", ", q_width, "]");
    TORCH_CHECK(layer.gate_up.kp == hidden_ && layer.gate_up.n % 2 == 0 &&
                    layer.down.kp == layer.gate_up.n / 2 && layer.down.n == hidden_,
                "add_layer: gate/up and down: expected [2I, ", hidden_, "] and [", hidden_, ", I]");
    layers_.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The most rows a step may have: the weight formats' few-row (integer) paths, at most 16.
  int64_t max_rows() const {
    int64_t most = 16;
    for (const auto& l : layers_)
      for (const QLin* lin : {&l.qkv, &l.o, &l.gate_up, &l.down})
        most = std::min<int64_t>(most, float_rows(lin->fmt) - 1);
    return most;
  }

  // x [m, hidden]: the step's rows after the embedding, replaced in place by the last
  // layer's output (before the final norm). cos, sin [m, head_dim]; k_caches, v_caches: per
  // layer [blocks, block_size, kv_heads, head_dim]; slots [m]: where each row's key and value
  // go; tables [m, width], lengths [m]: each row's block table and context length (its own
  // token included: a row attends to every slot of its table before that length, which
  // holds the rows before it of one sequence, stored in this step). Each row's result is
  // the same, bit for bit, whatever rows share its step.
  void run(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
           std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
           torch::Tensor slots, torch::Tensor tables, torch::Tensor lengths) {
    std::lock_guard<std::mutex> one_at_a_time(run_lock_);  // (its barriers are per stack)
    const int64_t layers = num_layers();
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2 &&
                    x.is_contiguous() && x.size(1) == hidden_,
                "x: expected a contiguous CPU float32 [m, ", hidden_, "] tensor");
    const int64_t m = x.size(0);
    TORCH_CHECK(m >= 1 && m <= max_rows(), "x: expected 1 to ", max_rows(), " rows, got ", m);
    TORCH_CHECK(cos.scalar_type() == torch::kFloat && cos.is_contiguous() && cos.dim() == 2 &&
                    cos.size(0) == m && cos.size(1) == dim_ && sin.sizes() == cos.sizes() &&
                    sin.scalar_type() == torch::kFloat && sin.is_contiguous(),
                "cos, sin: expected contiguous float32 [", m, ", ", dim_, "]");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == layers &&
                    static_cast<int64_t>(v_caches.size()) == layers,
                "k_caches, v_caches: expected ", layers, " tensors each");
    TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.numel() == m && slots.is_contiguous(),
                "slots: expected int64 [", m, "]");
    TORCH_CHECK(tables.scalar_type() == torch::kLong && tables.dim() == 2 &&
                    tables.size(0) == m && tables.is_contiguous(),
                "tables: expected contiguous int64 [", m, ", width]");
    TORCH_CHECK(lengths.scalar_type() == torch::kLong && lengths.numel() == m &&
                    lengths.is_contiguous(),
                "lengths: expected int64 [", m, "]");
    const auto shape = k_caches[0].sizes();
    for (int64_t l = 0; l < layers; ++l)
      for (const auto& c : {k_caches[l], v_caches[l]})
        TORCH_CHECK(c.scalar_type() == torch::kFloat && c.is_contiguous() && c.dim() == 4 &&
                        c.sizes() == shape && c.size(2) == kv_heads_ && c.size(3) == dim_,
                    "k_caches, v_caches: expected contiguous float32 [blocks, block_size, ",
                    kv_heads_, ", ", dim_, "], one shape");
    const int64_t blocks = shape[0], block_size = shape[1], width = tables.size(1);
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* table = tables.data_ptr<int64_t>();
    const int64_t* length = lengths.data_ptr<int64_t>();
    for (int64_t r = 0; r < m; ++r) {
      TORCH_CHECK(slot[r] >= 0 && slot[r] < blocks * block_size, "slots[", r, "] out of range");
      TORCH_CHECK(length[r] >= 1 && length[r] <= width * block_size, "lengths[", r, "] out of range");
      for (int64_t b = 0; b < (length[r] + block_size - 1) / block_size; ++b) {
        const int64_t id = table[r * width + b];
        TORCH_CHECK(id >= 0 && id < blocks, "tables[", r, ", ", b, "] = ", id, " out of range");
      }
    }

    const int64_t q_width = heads_ * dim_, kv_width = kv_heads_ * dim_;
    const int64_t qkv_width = q_width + 2 * kv_width, groups = heads_ / kv_heads_;
    const int64_t inter = layers_[0].gate_up.n / 2;
    std::vector<float> qkv(m * qkv_width), attn(m * q_width), part(m * hidden_),
        gate_up(m * 2 * inter);
    float* xs = x.data_ptr<float>();
    const float* cs = cos.data_ptr<float>();
    const float* sn = sin.data_ptr<float>();
    const AttendFn attend_one = rt_attn::attend_for(dim_);

    // One task per thread of torch's team (its OpenMP pool: no second one); a body given the
    // whole range (one thread, or a nested call) runs the step alone. Only OpenMP runs every
    // task of a parallel_for at once, which the barriers need: other backends (a task pool
    // that may queue tasks behind each other) run the step on one thread.
    const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
#if AT_PARALLEL_OPENMP
    const int64_t want = at::in_parallel_region() ? 1 : nt;
#else
    const int64_t want = 1;
    (void)nt;
#endif
    at::parallel_for(0, want, 1, [&](int64_t b0, int64_t b1) {
      // (parallel_for gives thread t the t-th of equal chunks: their size tells the team)
      const int64_t chunk = b0 == 0 ? b1 - b0 : b0 / std::max<int64_t>(1, at::get_thread_num());
      const int team = static_cast<int>((want + chunk - 1) / chunk);
      const int tid = static_cast<int>(b0 / chunk);
      step_thread(tid, team, m, xs, cs, sn, k_caches, v_caches, slot, table, width, length,
                  block_size, qkv.data(), attn.data(), part.data(), gate_up.data(), inter,
                  attend_one, groups, qkv_width, q_width, kv_width);
    });
  }

 private:
  SpinBarrier& barrier_for(int team) {
    std::lock_guard<std::mutex> hold(barrier_lock_);
    auto& slot = barriers_[team];
    if (!slot) slot = std::make_unique<SpinBarrier>(team);
    return *slot;
  }

  void step_thread(int tid, int team, int64_t m, float* x, const float* cs, const float* sn,
                   const std::vector<torch::Tensor>& k_caches,
                   const std::vector<torch::Tensor>& v_caches, const int64_t* slot,
                   const int64_t* table, int64_t width, const int64_t* length,
                   int64_t block_size, float* qkv, float* attn, float* part, float* gate_up,
                   int64_t inter, AttendFn attend_one, int64_t groups, int64_t qkv_width,
                   int64_t q_width, int64_t kv_width) {
    SpinBarrier& barrier = barrier_for(team);
    thread_local std::vector<float> xn, act, scores;
    thread_local Activations quant;
    const int64_t h = hidden_;
    xn.resize(m * h);
    act.resize(m * std::max(q_width, inter));
    const auto [h0, h1] = share(h, tid, team);
    for (const StackLayer& layer : layers_) {
      const int64_t l = &layer - layers_.data();
      // attention: x += o(attend(rope(qkv(norm1(x)))))
      for (int64_t r = 0; r < m; ++r)
        rt_attn::rms_row(x + r * h, layer.norm1.data_ptr<float>(), xn.data() + r * h, h, layer.eps1);
      prepare(quant, xn.data(), m, layer.qkv);
      const auto [q0, q1] = share(qkv_width, tid, team);
      product(quant, layer.qkv, m, simd_, qkv, q0, q1);
      barrier.wait();
      float* kc = k_caches[l].data_ptr<float>();
      float* vc = v_caches[l].data_ptr<float>();
      // Rows are tokens: a verified draft's rows attend to the keys and values of the rows
      // before them, so every row's are stored before any row attends.
      for (int64_t item = tid; item < m * kv_heads_; item += team) {
        const int64_t r = item / kv_heads_, kh = item % kv_heads_;
        float* row = qkv + r * qkv_width;
        float* k = row + q_width + kh * dim_;
        const float* v = row + q_width + kv_width + kh * dim_;
        rt_attn::rope_heads(row + kh * groups * dim_, cs + r * dim_, sn + r * dim_, groups, dim_);
        rt_attn::rope_heads(k, cs + r * dim_, sn + r * dim_, 1, dim_);
        std::memcpy(kc + slot[r] * kv_width + kh * dim_, k, dim_ * sizeof(float));
        std::memcpy(vc + slot[r] * kv_width + kh * dim_, v, dim_ * sizeof(float));
      }
      barrier.wait();
      // (per query head: nine items for SmolLM2's one row, not three per kv head, so two
      // threads share them evenly; a head's sums are the same either way)
      for (int64_t item = tid; item < m * heads_; item += team) {
        const int64_t r = item / heads_, hq = item % heads_, kh = hq / groups;
        attend_one(qkv + r * qkv_width + hq * dim_, attn + r * q_width + hq * dim_,
                   kc + kh * dim_, vc + kh * dim_, table + r * width, length[r], 1, 1, dim_,
                   block_size, kv_width, scale_, scores);
      }
      barrier.wait();
      prepare(quant, attn, m, layer.o);
      product(quant, layer.o, m, simd_, part, h0, h1);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = h0; j < h1; ++j) x[r * h + j] = x[r * h + j] + part[r * h + j];
      barrier.wait();
      // MLP: x += down(silu(gate) * up) of norm2(x)
      for (int64_t r = 0; r < m; ++r)
        rt_attn::rms_row(x + r * h, layer.norm2.data_ptr<float>(), xn.data() + r * h, h, layer.eps2);
      prepare(quant, xn.data(), m, layer.gate_up);
      const auto [g0, g1] = share(2 * inter, tid, team);
      product(quant, layer.gate_up, m, simd_, gate_up, g0, g1);
      barrier.wait();
      for (int64_t r = 0; r < m; ++r)
        rt_attn::silu_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, act.data() + r * inter,
                 inter);
      prepare(quant, act.data(), m, layer.down);
      product(quant, layer.down, m, simd_, part, h0, h1);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = h0; j < h1; ++j) x[r * h + j] += part[r * h + j];
      barrier.wait();
    }
  }

  const int64_t hidden_, heads_, kv_heads_, dim_;
  const float scale_;
  const bool simd_;
  std::vector<StackLayer> layers_;
  std::mutex barrier_lock_, run_lock_;
  std::map<int, std::unique_ptr<SpinBarrier>> barriers_;
};
