// Splitting a quantized product's output rows over the intra-op threads so that a thread which
// starts late does not hold up the others (included by ops.cpp, with ATen).
//
// at::parallel_for gives each thread an equal share. On the 2-vCPU Intel VM the second thread
// starts its share 2-3 us after the call (rdtsc inside graphrt::linear_quantized at batch 1:
// 5,000-7,600 cycles at 2.6 GHz; it sleeps between regions), so the first waits about that long
// at the end of every region, and a decode step has about 150 of them. Here each thread owns a
// contiguous range of pieces and takes it front to back, so its weights still stream in address
// order; a thread done with its own takes pieces from the back of the others' ranges. A range's
// front and back are packed in one atomic word, so a piece is taken exactly once. A batch-1 int4
// decode step (a loop of LLM.engine.step, three interleaved pairs): 5.10 / 5.03 / 5.06 ms against
// 5.20 / 5.29 / 5.28 with the even split.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace graphrt_native {

// Pieces [0, P) in one contiguous range per owner thread.
class PieceRanges {
 public:
  PieceRanges(int64_t pieces, int64_t owners) : n_(owners), ranges_(new std::atomic<uint64_t>[owners]) {
    for (int64_t t = 0; t < owners; ++t) ranges_[t].store(pack(t * pieces / owners, (t + 1) * pieces / owners));
  }
  int64_t owners() const { return n_; }
  // The owner's next piece from the front of its range, or the next from the back of another's.
  bool take_front(int64_t t, int64_t& piece) { return take(t, true, piece); }
  bool take_back(int64_t t, int64_t& piece) { return take(t, false, piece); }

 private:
  static uint64_t pack(int64_t front, int64_t back) { return uint64_t(front) << 32 | uint64_t(back); }
  bool take(int64_t t, bool front, int64_t& piece) {
    std::atomic<uint64_t>& r = ranges_[t];
    uint64_t cur = r.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = int64_t(cur >> 32), b = int64_t(cur & 0xffffffffu);
      if (f >= b) return false;
      const uint64_t next = front ? pack(f + 1, b) : pack(f, b - 1);
      if (r.compare_exchange_weak(cur, next, std::memory_order_relaxed)) {
        piece = front ? f : b - 1;
        return true;
      }
    }
  }
  int64_t n_;
  std::unique_ptr<std::atomic<uint64_t>[]> ranges_;
};

// Units [0, units) (a unit: a block of output rows, unit_bytes of weights) in pieces of at least
// 16 KiB of weights (32 and 64 KiB measured the same) and at most 64 a thread. make() runs once
// on each thread that takes part and returns its worker, called as work(u0, u1) for each piece
// the thread takes (its scratch lives in it). Up to `grain` units (or on one thread, or inside
// another parallel region) one worker takes them all, as at::parallel_for's grain would.
template <typename Make>
void parallel_rows_stealing(int64_t units, int64_t unit_bytes, int64_t grain, const Make& make) {
  constexpr int64_t kMinPieceBytes = 16 << 10;
  if (units <= 0) return;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t per_piece =
      std::max<int64_t>({1, kMinPieceBytes / std::max<int64_t>(1, unit_bytes), units / (64 * threads)});
  const int64_t pieces = (units + per_piece - 1) / per_piece;
  if (units <= grain || pieces <= 1 || threads == 1 || at::in_parallel_region()) {
    auto work = make();
    work(int64_t(0), units);
    return;
  }
  PieceRanges ranges(pieces, std::min(threads, pieces));
  at::parallel_for(0, ranges.owners(), 1, [&](int64_t t0, int64_t t1) {
    auto work = make();
    auto run = [&](int64_t piece) { work(piece * per_piece, std::min(units, (piece + 1) * per_piece)); };
    for (int64_t t = t0; t < t1; ++t) {
      int64_t piece;
      while (ranges.take_front(t, piece)) run(piece);
      for (int64_t k = 1; k < ranges.owners(); ++k)
        while (ranges.take_back((t + k) % ranges.owners(), piece)) run(piece);
    }
  });
}

}  // namespace graphrt_native
