// The CPU lane's mailbox server in native code (included by lane_kernel.cpp, after the pool and tm_lane_posted).
//
// Why: the device posts each fast-mode MoE layer's lane work to a mapped-memory mailbox
// (kernels/triton/mailbox.py) and waits for the answer on the device. A Python thread answering it holds the
// interpreter lock while it polls, so the engine's and the HTTP server's threads wait for that lock each time
// they come back from a call that released it, and the answer waits for the lock whenever they hold it. This
// thread polls, computes (the pool's tm_lane_posted, the same arithmetic as the Python server's
// CpuLane.compute_posted) and answers without the lock; Python only starts it, switches it between polling
// (a step that may post is running) and parked, and reads its counters.
//
// Protocol, as MailboxServer's: per slot, a post with sequence number `posted` > the last answered is served;
// the result rows are written, then DONE = posted (release). A failed computation zeroes the rows, sets
// ERR = -posted and still answers, so the device never stalls.
#pragma once

struct TmServerLayout {  // one record layout the lane reads (a mixed store has one per record kind)
  TmLaneJob job;         // kind, hidden, inter, group, section offsets, round_bf16 (the limit is set apart)
  int64_t weight_bytes;  // weight bytes of one expert of this layout (the counters' GB/s)
};

struct TmServerSlot {       // one mailbox slot: one MoE layer's records
  const uint64_t* rec_of;   // [n_experts] host record address of each expert (read at every post: may move)
  const int8_t* layout_of;  // [n_experts] layout index of each expert (null: one layout)
  int32_t n_experts;
};

struct TmServerSpec {  // read through ctypes (kernels/cpu/native.py)
  int64_t* ctrl;       // [slots, ctrl_words] the mailbox's control words
  const uint16_t* x;   // [slots, max_tokens, hidden] bf16 requests
  float* result;       // [slots, max_tokens, hidden] fp32 answers
  const int32_t* meta;  // [slots, meta_words] lane ids | topk ids | weights (CpuLane.compute_posted)
  int32_t slots, ctrl_words, hidden, max_tokens, meta_words, lane_cap, top_k, n_layouts;
  int32_t w_posted, w_ntok, w_done, w_err;  // indices of those words in a ctrl row
  int32_t cpu;                              // the core the thread is pinned to (-1: none)
  const TmServerLayout* layouts;            // [n_layouts]
  const TmServerSlot* slot_specs;           // [slots]
};

struct TmServerStats {  // read through ctypes
  int64_t served, failed, experts, layers, weight_bytes, busy_ns, serve_ns;
  int32_t last_error, alive;
};

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Server {
  Pool* pool = nullptr;
  TmServerSpec spec{};
  std::vector<TmServerLayout> layouts;
  std::vector<TmServerSlot> slot_specs;
  std::atomic<bool> stop{false}, active{false};
  std::atomic<int32_t> has_limit{0}, last_error{0}, alive{0};
  std::atomic<float> limit{0.0f};
  std::atomic<int64_t> served{0}, failed{0}, experts{0}, layers{0}, weight_bytes{0}, busy_ns{0}, serve_ns{0};
  std::mutex m;
  std::condition_variable cv;
  std::thread thread;

  int64_t* ctrl(int s) const { return spec.ctrl + int64_t(s) * spec.ctrl_words; }

  // Slot s's post `seq`: every layout's lane experts into the result rows, then the answer.
  void serve(int s, int64_t seq) {
    const int64_t t0 = now_ns();
    const int64_t rows = int64_t(spec.max_tokens) * spec.hidden;
    float* res = spec.result + s * rows;
    const int t = int(__atomic_load_n(ctrl(s) + spec.w_ntok, __ATOMIC_ACQUIRE));
    int32_t rc = t >= 1 && t <= spec.max_tokens ? 0 : -1;
    int64_t n_exp = 0, bytes = 0, busy = 0;
    if (rc == 0) {
      std::memset(res, 0, sizeof(float) * size_t(t) * spec.hidden);
      const TmServerSlot& sl = slot_specs[s];
      for (int li = 0; li < spec.n_layouts && rc == 0; ++li) {
        TmPostedJob pj{};
        pj.job = layouts[li].job;
        pj.job.n_tok = t, pj.job.out = res;
        pj.job.has_limit = has_limit.load(std::memory_order_relaxed), pj.job.limit = limit.load();
        pj.meta = spec.meta + int64_t(s) * spec.meta_words;
        pj.lane_cap = spec.lane_cap, pj.top_k = spec.top_k;
        pj.rec_of = sl.rec_of, pj.layout_of = spec.n_layouts > 1 ? sl.layout_of : nullptr;
        pj.n_experts = sl.n_experts, pj.layout = li;
        pj.xb = spec.x + s * rows;
        int32_t n = 0;
        const int64_t k0 = now_ns();
        rc = tm_lane_posted(pool, &pj, &n);
        busy += now_ns() - k0;
        n_exp += n, bytes += int64_t(n) * layouts[li].weight_bytes;
      }
    }
    if (rc != 0) {  // nothing of a failed answer is counted as lane work (as the Python server's)
      std::memset(res, 0, sizeof(float) * size_t(std::max(0, std::min(t, spec.max_tokens))) * spec.hidden);
      __atomic_store_n(ctrl(s) + spec.w_err, -seq, __ATOMIC_RELAXED);
      last_error.store(rc);
      failed.fetch_add(1);
    } else {
      experts.fetch_add(n_exp), layers.fetch_add(1), weight_bytes.fetch_add(bytes), busy_ns.fetch_add(busy);
    }
    serve_ns.fetch_add(now_ns() - t0);
    served.fetch_add(1);  // counted before the answer is published, as MailboxServer does
    __atomic_store_n(ctrl(s) + spec.w_done, seq, __ATOMIC_RELEASE);
  }

  // Poll every slot; while `active` spin (the thread owns its core), else park on the condition variable and
  // look again every 50 ms (a post while parked is still answered).
  void run() {
    if (spec.cpu >= 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(spec.cpu, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    std::vector<int64_t> answered(spec.slots);
    for (int s = 0; s < spec.slots; ++s) answered[s] = __atomic_load_n(ctrl(s) + spec.w_done, __ATOMIC_ACQUIRE);
    for (uint64_t spins = 1; !stop.load(std::memory_order_relaxed); ++spins) {
      bool any = false;
      for (int s = 0; s < spec.slots; ++s) {
        const int64_t posted = __atomic_load_n(ctrl(s) + spec.w_posted, __ATOMIC_ACQUIRE);
        if (posted > answered[s]) {
          serve(s, posted);
          answered[s] = posted;
          any = true;
        }
      }
      if (any) continue;
      if (active.load(std::memory_order_acquire)) {
        if (spec.cpu < 0 && spins % 4096 == 0)
          std::this_thread::yield();  // not on a core of its own: let the threads it shares one with run
        else
          cpu_relax();
      } else {
        std::unique_lock<std::mutex> lock(m);
        cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return active.load() || stop.load(); });
      }
    }
    alive.store(0);
  }
};

}  // namespace

extern "C" {

// Start a server answering spec's mailbox with `pool` (spec and its arrays are copied; the memory they point
// to must outlive the server). Null: no thread could be started.
void* tm_server_start(void* pool, const TmServerSpec* spec) {
  Server* srv = new (std::nothrow) Server();
  if (!srv) return nullptr;
  try {
    srv->pool = static_cast<Pool*>(pool);
    srv->spec = *spec;
    srv->layouts.assign(spec->layouts, spec->layouts + spec->n_layouts);
    srv->slot_specs.assign(spec->slot_specs, spec->slot_specs + spec->slots);
    srv->alive.store(1);  // from here until run() returns
    srv->thread = std::thread([srv] { srv->run(); });
  } catch (...) {
    delete srv;
    return nullptr;
  }
  return srv;
}

// on != 0: a step that may post runs (poll without pause); 0: park between steps.
void tm_server_active(void* server, int32_t on) {
  Server& srv = *static_cast<Server*>(server);
  srv.active.store(on != 0, std::memory_order_release);
  if (on) {
    { std::lock_guard<std::mutex> lock(srv.m); }
    srv.cv.notify_all();
  }
}

// The SwiGLU clamp of later answers (has_limit 0: none).
void tm_server_limit(void* server, int32_t has_limit, float limit) {
  Server& srv = *static_cast<Server*>(server);
  srv.limit.store(limit);
  srv.has_limit.store(has_limit != 0);
}

void tm_server_stats(void* server, TmServerStats* out) {
  Server& srv = *static_cast<Server*>(server);
  *out = TmServerStats{srv.served.load(), srv.failed.load(), srv.experts.load(), srv.layers.load(),
                       srv.weight_bytes.load(), srv.busy_ns.load(), srv.serve_ns.load(), srv.last_error.load(),
                       srv.alive.load()};
}

// Stop polling, join the thread (after its current answer), write its final counters to *last (unless null)
// and free the server.
void tm_server_stop(void* server, TmServerStats* last) {
  Server* srv = static_cast<Server*>(server);
  srv->stop.store(true);
  { std::lock_guard<std::mutex> lock(srv->m); }
  srv->cv.notify_all();
  if (srv->thread.joinable()) srv->thread.join();
  if (last) tm_server_stats(srv, last);
  delete srv;
}

}  // extern "C"
