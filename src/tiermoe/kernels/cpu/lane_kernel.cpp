// CPU lane kernel: routed SwiGLU experts computed straight from expert records (docs/store-format.md).
//
// Why a kernel of our own: torch's CPU int4/int8 kernels want their own weight layouts, so the lane
// used to repack every record on use, which cost far more than the matrix-vector products. This
// reads the records as the store and the GPU kernels lay them out (int4 nibbles, int3 bit planes or
// int8, each with bf16 group scales; bf16) and computes with the GPU kernels' numerics:
//   W' = bf16(float32(q) * float32(scale)) (int records; round_bf16 = 0 keeps the fp32 product)
//   g, u = x W'^T (fp32 sums); act = bf16(silu(min(g, L)) * clamp(u, -L, L)); y = act Wd'^T
//   out[token] += w * y, experts in the order given (ascending ids), fp32.
// Work is split by output rows over one pool of threads, so a single expert uses every thread;
// each row's sum is computed by one thread in a fixed order, so results do not depend on the
// thread count. Vector code for AVX-512 and AVX2 (chosen at run time) and a portable scalar path.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include <pthread.h>
#include <sched.h>

#include "lane_dot.h"

enum { TM_ABI = 8 };

struct TmLaneJob {  // read through ctypes (kernels/cpu/native.py)
  int32_t kind, hidden, inter, group;
  int64_t gu_q, gu_s, dn_q, dn_s;  // section offsets in a record (bytes); *_s unused for bf16
  int32_t n_exp, n_tok;            // experts, rows of x and out
  const uint64_t* rec;             // [n_exp] record addresses
  const int32_t* tok_off;          // [n_exp + 1] each expert's entries in tok_idx / tok_w
  const int32_t* tok_idx;          // [tok_off[n_exp]] rows of x routed to the expert
  const float* tok_w;              // [tok_off[n_exp]] their routing weights
  const float* x;                  // [n_tok, hidden]
  float* out;                      // [n_tok, hidden], added to
  int32_t round_bf16, has_limit;
  float limit;
};

// A decode layer's lane work as the device posted it (moe/device_lane.py): the routing set-up that the
// caller would otherwise do per layer in Python (which picks go to which lane expert, in the order
// torch.where((topk_ids == e).t()) gives: pick position, then token) is done here.
struct TmPostedJob {  // read through ctypes (kernels/cpu/native.py)
  TmLaneJob job;            // layout, n_tok, out, round_bf16, limit; rec, tok_*, x and n_exp are filled here
  const int32_t* meta;      // lane ids [lane_cap] (-1: none) | topk ids [n_tok, top_k] | weights fp32 [n_tok, top_k]
  int32_t lane_cap, top_k;
  const uint64_t* rec_of;   // [n_experts] record address of each expert id
  const int8_t* layout_of;  // [n_experts] each expert's layout index (null: every expert is `layout`)
  int32_t n_experts, layout;
  const uint16_t* xb;       // [n_tok, hidden] bf16 activations
};

namespace {

inline Mat matrix(const TmLaneJob& j, int e, bool down) {
  const uint8_t* base = reinterpret_cast<const uint8_t*>(j.rec[e]);
  int K = down ? j.inter : j.hidden;
  int per = j.kind == KIND_INT4 ? K / 2 : j.kind == KIND_INT3 ? 3 * K / 8 : j.kind == KIND_INT8 ? K : 2 * K;
  const uint8_t* sb = base + (down ? j.dn_s : j.gu_s);
  const uint16_t* s = j.kind == KIND_BF16 ? nullptr : reinterpret_cast<const uint16_t*>(sb);
  return Mat{base + (down ? j.dn_q : j.gu_q), s, per, K, j.group};
}

using DotFn = void (*)(const Mat&, const int*, const float* const*, int, bool, float[][4]);

// dots[isa][R - 1][NT - 1] (fp32 inputs)
DotFn g_dots[3][2][4];
using BDotFn = void (*)(const Mat&, const int*, const uint16_t* const*, int, float[][4]);
BDotFn g_bdots[2][4];  // avx512bf16::dot<R, NT>, [R - 1][NT - 1] (bf16 inputs)

template <int R, int NT>
void fill_one() {
  g_dots[ISA_SCALAR][R - 1][NT - 1] = dot_scalar<R, NT>;
#if TM_X86
  g_dots[ISA_AVX2][R - 1][NT - 1] = avx2::dot<R, NT>;
  g_dots[ISA_AVX512][R - 1][NT - 1] = avx512::dot<R, NT>;
  g_bdots[R - 1][NT - 1] = avx512bf16::dot<R, NT>;
#endif
}

struct DotInit {
  DotInit() {
    fill_one<1, 1>(), fill_one<1, 2>(), fill_one<1, 3>(), fill_one<1, 4>();
    fill_one<2, 1>(), fill_one<2, 2>(), fill_one<2, 3>(), fill_one<2, 4>();
  }
} g_dot_init;

int detect_isa() {
#if TM_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return __builtin_cpu_supports("avx512bf16") ? ISA_AVX512BF16 : ISA_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
#endif
  return ISA_SCALAR;
}

bool has_vbmi() {  // the bf16 int3 path's vpmultishiftqb (avx512vbmi::dot_int3)
#if TM_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

inline void cpu_relax() {
#if TM_X86
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Scratch memory on 64-byte boundaries: the AVX-512 dot products load inputs and activations a cache line at
// a time from rows a whole number of lines long, so then no load straddles two lines. malloc's 16-byte
// boundaries left that to chance: the same kernel ran up to a quarter slower at four tokens in one pool
// than in another.
template <typename T>
struct Aligned {
  using value_type = T;
  Aligned() = default;
  template <typename U>
  Aligned(const Aligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned<U>&) const { return false; }
};
template <typename T>
using Scratch = std::vector<T, Aligned<T>>;

// A pool of worker threads (pinned to the given CPUs) that, with the calling thread, run the items
// of one parallel step, taking them from a shared counter. Workers spin for `spin_us` after a step
// (the next MoE layer's step follows shortly) and then sleep on a condition variable.
struct Pool {
  int n = 1;
  int isa = ISA_SCALAR;
  int64_t spin_us = 500;
  // Work items and prefetches (tm_pool_tune; `tiermoe bench lane --item-rows --ahead-rows` measures them):
  // gate/up rows (of each half) and down rows per item, rows ahead that prefetches reach, their locality.
  int rows_gu = 16, rows_down = 16, ahead_rows = 2, hint = 3;
  std::vector<std::thread> threads;
  std::atomic<uint64_t> gen{0};
  std::atomic<int> pending{0}, next{0};
  std::atomic<bool> stop{false};
  void (*fn)(void*, int) = nullptr;
  void* ctx = nullptr;
  int items = 0;
  std::mutex m, job;
  std::condition_variable cv;
  Scratch<float> xp, act;       // scratch: reordered inputs [n_tok, H], activations [entries, I]
  Scratch<uint16_t> xb, actb;  // the same in bf16 (ISA_AVX512BF16)
  // a posted job's routing and inputs (tm_lane_posted), filled under `job`
  std::vector<uint64_t> post_rec;
  std::vector<int32_t> post_off, post_idx;
  std::vector<float> post_w, post_x;

  void run_items() {
    for (;;) {
      int i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= items) return;
      fn(ctx, i);
    }
  }

  void worker(int cpu) {
    if (cpu >= 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpu, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    uint64_t seen = 0;
    for (;;) {
      auto t0 = std::chrono::steady_clock::now();
      for (int spins = 1; gen.load(std::memory_order_acquire) == seen && !stop.load(); ++spins) {
        cpu_relax();
        if (spins % 1024 == 0 &&
            std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(spin_us)) {
          std::unique_lock<std::mutex> lock(m);
          cv.wait(lock, [&] { return gen.load(std::memory_order_acquire) != seen || stop.load(); });
        }
      }
      if (stop.load()) return;
      seen = gen.load(std::memory_order_acquire);
      run_items();
      pending.fetch_sub(1, std::memory_order_release);
    }
  }

  void parallel(void (*f)(void*, int), void* c, int count) {
    fn = f, ctx = c, items = count;
    next.store(0, std::memory_order_relaxed);
    if (n == 1 || count == 1) {
      run_items();
      return;
    }
    pending.store(n - 1, std::memory_order_relaxed);
    gen.fetch_add(1, std::memory_order_release);
    { std::lock_guard<std::mutex> lock(m); }  // a worker between its check and its wait sees the new step
    cv.notify_all();
    run_items();
    for (int spins = 1; pending.load(std::memory_order_acquire) != 0; ++spins)
      if (spins % 4096 == 0) std::this_thread::yield(); else cpu_relax();
  }

  ~Pool() {
    stop.store(true);
    { std::lock_guard<std::mutex> lock(m); }
    cv.notify_all();
    for (auto& t : threads) t.join();
  }
};

struct Ctx {
  const TmLaneJob* j;
  Pool* p;
  int isa;      // ISA_AVX512BF16: bf16 inputs and dot products; else fp32 inputs
  int perm;     // int4 vector paths: input column order perm32 (fp32) or perm64 (bf16); 0: natural
  bool rnd;
  const float* xin;     // [n_tok, H] fp32 inputs (x, or x reordered)
  const uint16_t* xbin;  // [n_tok, H] bf16 inputs (ISA_AVX512BF16)
};

inline int order(const Ctx& c, int k) { return c.perm == 32 ? perm32(k) : (c.perm == 64 ? perm64(k) : k); }

inline void dots(const Ctx& c, const Mat& m, const int* rows, int R, const float* const* x, int nt, float res[][4]) {
  g_dots[c.isa][R - 1][nt - 1](m, rows, x, c.j->kind, c.rnd, res);
}

inline void dots(const Ctx& c, const Mat& m, const int* rows, int R, const uint16_t* const* x, int nt,
                 float res[][4]) {
  g_bdots[R - 1][nt - 1](m, rows, x, c.j->kind, res);
}

void prep_item(void* vc, int t) {  // one token row of x into the kernel's input order (and bf16)
  const Ctx& c = *static_cast<Ctx*>(vc);
  int H = c.j->hidden;
  const float* src = c.j->x + int64_t(t) * H;
  if (c.isa == ISA_AVX512BF16) {
    uint16_t* dst = c.p->xb.data() + int64_t(t) * H;
    for (int k = 0; k < H; ++k) dst[order(c, k)] = bf16_bits(src[k]);
  } else {
    float* dst = c.p->xp.data() + int64_t(t) * H;
    for (int k = 0; k < H; ++k) dst[order(c, k)] = src[k];
  }
}

template <typename In>
const In* inputs(const Ctx& c);
template <>
const float* inputs<float>(const Ctx& c) { return c.xin; }
template <>
const uint16_t* inputs<uint16_t>(const Ctx& c) { return c.xbin; }

inline void store_act(const Ctx& c, int64_t at, float a, float*) { c.p->act[at] = c.rnd ? round_bf16(a) : a; }
inline void store_act(const Ctx& c, int64_t at, float a, uint16_t*) { c.p->actb[at] = bf16_bits(round_bf16(a)); }
inline const float* act_row(const Ctx& c, int64_t row, float*) { return c.p->act.data() + row * c.j->inter; }
inline const uint16_t* act_row(const Ctx& c, int64_t row, uint16_t*) { return c.p->actb.data() + row * c.j->inter; }

template <typename In>
void gate_up_t(const Ctx& c, int item) {
  const TmLaneJob& j = *c.j;
  const int rows = c.p->rows_gu, ahead = c.p->ahead_rows;
  int per = (j.inter + rows - 1) / rows, e = item / per, j0 = item % per * rows, j1 = std::min(j.inter, j0 + rows);
  Mat m = matrix(j, e, false);
  m.hint = c.p->hint;
  int b = j.tok_off[e], n = j.tok_off[e + 1] - b;
  for (int t0 = 0; t0 < n; t0 += 4) {
    int nt = std::min(4, n - t0);
    const In* x[4];
    for (int t = 0; t < nt; ++t) x[t] = inputs<In>(c) + int64_t(j.tok_idx[b + t0 + t]) * j.hidden;
    for (int r = j0; r < j1; ++r) {
      int rows[2] = {r, r + j.inter};
      float res[2][4];
      m.ahead = ahead > 0 && r + ahead < j1 ? ahead * m.row_bytes : 0;  // this item's rows (the next may be
                                                                          // another thread's)
      dots(c, m, rows, 2, x, nt, res);
      for (int t = 0; t < nt; ++t) {
        float g = res[0][t], u = res[1][t];
        if (j.has_limit) g = std::min(g, j.limit), u = std::max(std::min(u, j.limit), -j.limit);
        store_act(c, int64_t(b + t0 + t) * j.inter + order(c, r), g / (1.0f + std::exp(-g)) * u, (In*)nullptr);
      }
    }
  }
}

template <typename In>
void down_t(const Ctx& c, int item) {
  const TmLaneJob& j = *c.j;
  const int ahead = c.p->ahead_rows;
  int h0 = item * c.p->rows_down, h1 = std::min(j.hidden, h0 + c.p->rows_down);
  for (int e = 0; e < j.n_exp; ++e) {
    Mat m = matrix(j, e, true);
    m.hint = c.p->hint;
    int b = j.tok_off[e], n = j.tok_off[e + 1] - b;
    for (int t0 = 0; t0 < n; t0 += 4) {
      int nt = std::min(4, n - t0);
      const In* a[4];
      for (int t = 0; t < nt; ++t) a[t] = act_row(c, b + t0 + t, (In*)nullptr);
      for (int h = h0; h < h1; h += 2) {
        int rows[2] = {h, h + 1}, R = h + 1 < h1 ? 2 : 1;
        float res[2][4];
        m.ahead = ahead > 0 && h + 1 + ahead < h1 ? ahead * m.row_bytes : 0;
        dots(c, m, rows, R, a, nt, res);
        for (int r = 0; r < R; ++r)
          for (int t = 0; t < nt; ++t)
            j.out[int64_t(j.tok_idx[b + t0 + t]) * j.hidden + h + r] += j.tok_w[b + t0 + t] * res[r][t];
      }
    }
  }
}

void gate_up_item(void* vc, int item) {
  const Ctx& c = *static_cast<Ctx*>(vc);
  if (c.isa == ISA_AVX512BF16)
    gate_up_t<uint16_t>(c, item);
  else
    gate_up_t<float>(c, item);
}

void down_item(void* vc, int item) {
  const Ctx& c = *static_cast<Ctx*>(vc);
  if (c.isa == ISA_AVX512BF16)
    down_t<uint16_t>(c, item);
  else
    down_t<float>(c, item);
}

uint64_t g_read_sink = 0;

struct ReadCtx {
  const uint64_t* p;
  int64_t words, per;
  std::atomic<uint64_t> sum{0};
};

void read_item(void* vc, int i) {
  ReadCtx& c = *static_cast<ReadCtx*>(vc);
  int64_t a = i * c.per, b = std::min(c.words, a + c.per);
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t k = a;
  for (; k + 4 <= b; k += 4) s0 ^= c.p[k], s1 ^= c.p[k + 1], s2 ^= c.p[k + 2], s3 ^= c.p[k + 3];
  for (; k < b; ++k) s0 ^= c.p[k];
  c.sum.fetch_xor(s0 ^ s1 ^ s2 ^ s3, std::memory_order_relaxed);
}

}  // namespace

extern "C" {

int32_t tm_abi() { return TM_ABI; }

int32_t tm_cpu_isa() { return detect_isa(); }

void* tm_pool_new(int32_t threads, const int32_t* cpus, int32_t ncpus, int32_t isa_cap, int32_t spin_us) {
  Pool* p = new (std::nothrow) Pool();
  if (!p) return nullptr;
  p->n = std::max(1, int(threads));
  p->isa = std::min(detect_isa(), int(isa_cap));
  p->spin_us = spin_us;
  try {
    for (int i = 1; i < p->n; ++i) {
      int cpu = ncpus > 0 ? cpus[i % ncpus] : -1;
      p->threads.emplace_back([p, cpu] { p->worker(cpu); });
    }
  } catch (...) {
    delete p;
    return nullptr;
  }
  return p;
}

// Rows per work item (gate/up, down), rows ahead that prefetches reach (0: none) and their locality (1-3).
// 0: set; -1: out of range. Takes effect from the next job.
int32_t tm_pool_tune(void* pool, int32_t rows_gu, int32_t rows_down, int32_t ahead_rows, int32_t hint) {
  Pool& p = *static_cast<Pool*>(pool);
  if (rows_gu < 1 || rows_down < 1 || ahead_rows < 0 || hint < 1 || hint > 3) return -1;
  std::lock_guard<std::mutex> lock(p.job);
  p.rows_gu = rows_gu, p.rows_down = rows_down, p.ahead_rows = ahead_rows, p.hint = hint;
  return 0;
}

void tm_pool_free(void* pool) { delete static_cast<Pool*>(pool); }

int32_t tm_pool_isa(void* pool) { return static_cast<Pool*>(pool)->isa; }

}  // extern "C"

namespace {

// tm_lane_run's work with the pool's `job` lock held.
int32_t run_locked(Pool& p, const TmLaneJob& j) {
  if (j.kind < KIND_BF16 || j.kind > KIND_INT3 || j.hidden <= 0 || j.inter <= 0 || j.n_exp < 0 || j.n_tok < 0)
    return -1;
  if (j.kind != KIND_BF16 && (j.group <= 0 || j.hidden % j.group || j.inter % j.group || j.group % 2)) return -1;
  if (j.kind == KIND_INT3 && (j.hidden % 8 || j.inter % 8)) return -1;  // whole bytes of each bit plane
  for (int e = 0; e < j.n_exp; ++e)
    if (!j.rec[e] || j.tok_off[e + 1] < j.tok_off[e]) return -1;
  if (j.n_exp == 0) return 0;
  // vector paths need whole blocks in a group: 32 columns (int4; 64 for bf16 dot products) or 16 (int8 and
  // int3; 32 for bf16 dot products, but for int3 with G = 16, whose vectors take two groups)
  int isa = p.isa;
  if (isa == ISA_AVX512BF16 && (!j.round_bf16 || j.hidden % 64 || j.inter % 64 ||
                                (j.kind == KIND_INT4 && j.group % 64) || (j.kind == KIND_INT8 && j.group % 32) ||
                                (j.kind == KIND_INT3 && ((j.group % 32 && j.group != 16) || !has_vbmi()))))
    isa = ISA_AVX512;  // bf16 dot products give bf16 numerics only
  bool ok = j.kind == KIND_INT4 ? j.group % 32 == 0 : (j.kind == KIND_BF16 || j.group % 16 == 0);
  if (!ok || j.hidden % 16 || j.inter % 16) isa = ISA_SCALAR;
  int perm = j.kind != KIND_INT4 || isa == ISA_SCALAR ? 0 : (isa == ISA_AVX512BF16 ? 64 : 32);
  Ctx c{&j, &p, isa, perm, j.round_bf16 != 0, j.x, nullptr};
  size_t xs = size_t(j.n_tok) * j.hidden, acts = size_t(j.tok_off[j.n_exp]) * j.inter;
  try {
    if (isa == ISA_AVX512BF16) {
      if (p.xb.size() < xs) p.xb.resize(xs);
      if (p.actb.size() < acts) p.actb.resize(acts);
    } else {
      if (perm && p.xp.size() < xs) p.xp.resize(xs);
      if (p.act.size() < acts) p.act.resize(acts);
    }
  } catch (const std::bad_alloc&) {
    return -2;
  }
  if (perm || isa == ISA_AVX512BF16) {
    p.parallel(prep_item, &c, j.n_tok);
    c.xin = p.xp.data();
    c.xbin = p.xb.data();
  }
  p.parallel(gate_up_item, &c, j.n_exp * ((j.inter + p.rows_gu - 1) / p.rows_gu));
  p.parallel(down_item, &c, (j.hidden + p.rows_down - 1) / p.rows_down);
  return 0;
}

// A posted job's lane experts of its layout (ascending ids), their picks and the fp32 inputs, into the pool's
// post_* vectors and pj.job. -1: an id out of range or without a record.
int32_t fill_posted(Pool& p, TmPostedJob& pj) {
  TmLaneJob& j = pj.job;
  const int32_t* ids = pj.meta + pj.lane_cap;                                           // [n_tok, top_k]
  const float* w = reinterpret_cast<const float*>(pj.meta + pj.lane_cap + j.n_tok * pj.top_k);  // [n_tok, top_k]
  std::vector<int32_t> lane;
  for (int i = 0; i < pj.lane_cap; ++i) {
    int32_t e = pj.meta[i];
    if (e < 0) continue;
    if (e >= pj.n_experts || !pj.rec_of[e]) return -1;
    if (!pj.layout_of || pj.layout_of[e] == pj.layout) lane.push_back(e);
  }
  std::sort(lane.begin(), lane.end());
  lane.erase(std::unique(lane.begin(), lane.end()), lane.end());
  p.post_rec.clear(), p.post_off.assign(1, 0), p.post_idx.clear(), p.post_w.clear();
  for (int32_t e : lane) {
    p.post_rec.push_back(pj.rec_of[e]);
    for (int k = 0; k < pj.top_k; ++k)
      for (int t = 0; t < j.n_tok; ++t)
        if (ids[t * pj.top_k + k] == e) p.post_idx.push_back(t), p.post_w.push_back(w[t * pj.top_k + k]);
    p.post_off.push_back(int32_t(p.post_idx.size()));
  }
  size_t xs = size_t(j.n_tok) * j.hidden;
  p.post_x.resize(xs);
  for (size_t i = 0; i < xs; ++i) p.post_x[i] = bf16_to_f32(pj.xb[i]);
  j.n_exp = int32_t(lane.size());
  j.rec = p.post_rec.data(), j.tok_off = p.post_off.data(), j.tok_idx = p.post_idx.data();
  j.tok_w = p.post_w.data(), j.x = p.post_x.data();
  return 0;
}

}  // namespace

extern "C" {

// 0: done; -1: a shape the kernel does not take; -2: out of memory.
int32_t tm_lane_run(void* pool, const TmLaneJob* job) {
  Pool& p = *static_cast<Pool*>(pool);
  std::lock_guard<std::mutex> lock(p.job);
  return run_locked(p, *job);
}

// A posted decode layer (TmPostedJob): its lane experts of `layout` computed into job.out (added to). Returns
// tm_lane_run's codes; *computed: the experts it computed.
int32_t tm_lane_posted(void* pool, TmPostedJob* pj, int32_t* computed) {
  Pool& p = *static_cast<Pool*>(pool);
  *computed = 0;
  if (pj->lane_cap < 0 || pj->top_k <= 0 || pj->job.n_tok < 0 || pj->n_experts < 0) return -1;
  std::lock_guard<std::mutex> lock(p.job);
  int32_t rc;
  try {
    rc = fill_posted(p, *pj);
  } catch (const std::bad_alloc&) {
    return -2;
  }
  if (rc != 0) return rc;
  rc = run_locked(p, pj->job);
  if (rc == 0) *computed = pj->job.n_exp;
  return rc;
}

// Read every byte of [ptr, ptr + nbytes) with the pool's threads (a host read bandwidth probe).
uint64_t tm_read(void* pool, const void* ptr, int64_t nbytes) {
  Pool& p = *static_cast<Pool*>(pool);
  std::lock_guard<std::mutex> lock(p.job);
  ReadCtx c;
  c.p = static_cast<const uint64_t*>(ptr);
  c.words = nbytes / 8;
  c.per = 1 << 17;  // 1 MiB per item
  p.parallel(read_item, &c, int((c.words + c.per - 1) / c.per));
  g_read_sink ^= c.sum.load();
  return c.sum.load();
}

}  // extern "C"

#include "lane_server.h"
