#include "box_copy.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace layoutlang::nccl {

namespace {

// cudaMemcpy2D/3D reject pitches above cudaDevAttrMaxPitch, which is 2^31 - 1 on every
// current GPU; rows farther apart are copied one by one.
constexpr uint64_t kMaxPitch = 2147483647ULL;

struct Dim {
  uint64_t size;
  uint64_t ds;  // destination stride, bytes
  uint64_t ss;  // source stride, bytes
};

void push(std::vector<PitchedCopy>& out, const PitchedCopy& c) {
  // Adjacent contiguous copies merge: the common case of consecutive pieces of one message.
  if (!out.empty() && c.height == 1 && c.depth == 1) {
    PitchedCopy& prev = out.back();
    if (prev.height == 1 && prev.depth == 1 && prev.dst + prev.width == c.dst && prev.src + prev.width == c.src) {
      prev.width += c.width;
      return;
    }
  }
  out.push_back(c);
}

bool pitch_ok(uint64_t pitch, uint64_t width) {
  return pitch >= width && pitch <= kMaxPitch;
}

// dims: outer -> inner, without the innermost contiguous run (that is `width`).
void emit(std::vector<PitchedCopy>& out, uint64_t dst, uint64_t src, uint64_t width, const Dim* dims, std::size_t n) {
  if (n == 0) {
    push(out, PitchedCopy{dst, src, width, 1, 1, width, width, 1, 1});
    return;
  }
  if (n == 1) {
    const Dim& d = dims[0];
    if (pitch_ok(d.ds, width) && pitch_ok(d.ss, width)) {
      push(out, PitchedCopy{dst, src, width, d.size, 1, d.ds, d.ss, d.size, d.size});
    } else {
      for (uint64_t i = 0; i < d.size; ++i) push(out, PitchedCopy{dst + i * d.ds, src + i * d.ss, width, 1, 1, width, width, 1, 1});
    }
    return;
  }
  if (n == 2) {
    const Dim& outer = dims[0];
    const Dim& inner = dims[1];
    const bool rows_ok = pitch_ok(inner.ds, width) && pitch_ok(inner.ss, width) && inner.ds > 0 && inner.ss > 0;
    if (rows_ok && outer.ds % inner.ds == 0 && outer.ss % inner.ss == 0) {
      const uint64_t dheight = outer.ds / inner.ds;
      const uint64_t sheight = outer.ss / inner.ss;
      if (dheight >= inner.size && sheight >= inner.size) {
        push(out, PitchedCopy{dst, src, width, inner.size, outer.size, inner.ds, inner.ss, dheight, sheight});
        return;
      }
    }
  }
  // Loop the outermost dim.
  for (uint64_t i = 0; i < dims[0].size; ++i) emit(out, dst + i * dims[0].ds, src + i * dims[0].ss, width, dims + 1, n - 1);
}

}  // namespace

std::vector<PitchedCopy> plan_box_copies(const std::vector<BoxCopy>& copies) {
  std::vector<PitchedCopy> out;
  out.reserve(copies.size());
  for (std::size_t k = 0; k < copies.size(); ++k) {
    const BoxCopy& c = copies[k];
    const std::size_t nd = c.sizes.size();
    if (c.dst_strides.size() != nd || c.src_strides.size() != nd) {
      throw std::invalid_argument("box copy " + std::to_string(k) + ": sizes and strides have different lengths");
    }
    if (c.itemsize <= 0) throw std::invalid_argument("box copy " + std::to_string(k) + ": itemsize must be positive");
    bool empty = false;
    std::vector<Dim> merged;  // inner -> outer
    for (std::size_t i = nd; i-- > 0;) {
      if (c.sizes[i] < 0 || c.dst_strides[i] < 0 || c.src_strides[i] < 0) {
        throw std::invalid_argument("box copy " + std::to_string(k) + ": negative size or stride in dim " +
                                    std::to_string(i));
      }
      if (c.sizes[i] == 0) empty = true;
      if (c.sizes[i] == 1) continue;
      Dim d{static_cast<uint64_t>(c.sizes[i]), static_cast<uint64_t>(c.dst_strides[i] * c.itemsize),
            static_cast<uint64_t>(c.src_strides[i] * c.itemsize)};
      if (!merged.empty()) {
        Dim& in = merged.back();
        if (d.ds == in.ds * in.size && d.ss == in.ss * in.size) {
          in.size *= d.size;
          continue;
        }
      }
      merged.push_back(d);
    }
    if (empty) continue;
    const uint64_t item = static_cast<uint64_t>(c.itemsize);
    uint64_t width = item;
    if (!merged.empty() && merged.front().ds == item && merged.front().ss == item) {
      width = merged.front().size * item;
      merged.erase(merged.begin());
    }
    std::reverse(merged.begin(), merged.end());  // outer -> inner
    emit(out, c.dst, c.src, width, merged.data(), merged.size());
  }
  return out;
}

CopyStats run_box_copies(CudaApi& cuda, const std::vector<PitchedCopy>& plan, uint64_t stream) {
  CopyStats stats;
  void* s = reinterpret_cast<void*>(static_cast<uintptr_t>(stream));
  for (const PitchedCopy& c : plan) {
    void* dst = reinterpret_cast<void*>(static_cast<uintptr_t>(c.dst));
    const void* src = reinterpret_cast<const void*>(static_cast<uintptr_t>(c.src));
    if (c.height == 1 && c.depth == 1) {
      check_cuda(cuda, "cudaMemcpyAsync", cuda.memcpyAsync(dst, src, c.width, s));
    } else if (c.depth == 1) {
      check_cuda(cuda, "cudaMemcpy2DAsync", cuda.memcpy2DAsync(dst, c.dpitch, src, c.spitch, c.width, c.height, s));
    } else {
      CudaMemcpy3DParms p{};
      p.srcPtr = CudaPitchedPtr{const_cast<void*>(src), c.spitch, c.width, c.sheight};
      p.dstPtr = CudaPitchedPtr{dst, c.dpitch, c.width, c.dheight};
      p.extent = CudaExtent{c.width, c.height, c.depth};
      p.kind = kCudaMemcpyDefault;
      check_cuda(cuda, "cudaMemcpy3DAsync", cuda.memcpy3DAsync(&p, s));
    }
    stats.calls += 1;
    stats.bytes += static_cast<int64_t>(c.width * c.height * c.depth);
  }
  return stats;
}

}  // namespace layoutlang::nccl
