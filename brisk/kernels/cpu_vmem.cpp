// Virtual memory for the virtual KV layout (runtime/virtual_kv.py): reserve address space without
// backing it, commit pages ahead of the tokens that will fill them, give them back when a request
// ends. Linux calls (mmap MAP_NORESERVE, madvise MADV_POPULATE_WRITE / MADV_DONTNEED, mincore);
// elsewhere every call raises and names the fallback.
#include <torch/extension.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL and pages are touched instead
#endif
#endif

namespace {

constexpr const char* kFallback = "; use the paged layout instead (--kv-layout paged)";

#if defined(__linux__)

std::string os_error(const char* what, size_t bytes) {
  return std::string("virtual KV: ") + what + " of " + std::to_string(bytes) + " bytes failed: " +
         std::strerror(errno) + kFallback;
}

size_t page_size() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// A uint8 tensor over `nbytes` of reserved, not yet committed, address space; munmap on free.
// MAP_NORESERVE: the reservation takes no swap or overcommit charge; pages are committed by
// their first write (or vmem_populate).
torch::Tensor vmem_reserve(int64_t nbytes, bool huge_pages) {
  TORCH_CHECK(nbytes > 0, "virtual KV: a reservation needs > 0 bytes");
  const size_t n = static_cast<size_t>(nbytes);
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, os_error("reserving address space (mmap)", n));
  // THP on this range only when asked: a 2 MB page commits 2 MB at the first token that reaches it
  if (madvise(p, n, huge_pages ? MADV_HUGEPAGE : MADV_NOHUGEPAGE) != 0 && huge_pages) {
    munmap(p, n);
    TORCH_CHECK(false, os_error("asking for transparent huge pages (madvise MADV_HUGEPAGE)", n));
  }
  auto deleter = [n](void* q) { munmap(q, n); };
  return torch::from_blob(p, {nbytes}, deleter, torch::TensorOptions().dtype(torch::kUInt8));
}

char* range_of(const torch::Tensor& buf, int64_t offset, int64_t nbytes) {
  TORCH_CHECK(buf.dtype() == torch::kUInt8 && buf.dim() == 1 && buf.is_contiguous(),
              "virtual KV: expected a reservation from vmem_reserve");
  TORCH_CHECK(offset >= 0 && nbytes >= 0 && offset + nbytes <= buf.numel(),
              "virtual KV: range [", offset, ", ", offset + nbytes, ") outside a reservation of ", buf.numel(), " bytes");
  const size_t page = page_size();
  char* p = static_cast<char*>(buf.data_ptr()) + offset;
  TORCH_CHECK(reinterpret_cast<uintptr_t>(p) % page == 0 && static_cast<size_t>(nbytes) % page == 0,
              "virtual KV: range [", offset, ", ", offset + nbytes, ") is not whole pages of ", page, " bytes");
  return p;
}

// Commit the pages of a range (written soon): one system call instead of a fault per page.
void vmem_populate(const torch::Tensor& buf, int64_t offset, int64_t nbytes) {
  char* p = range_of(buf, offset, nbytes);
  if (nbytes == 0) return;
  if (madvise(p, static_cast<size_t>(nbytes), MADV_POPULATE_WRITE) == 0) return;
  TORCH_CHECK(errno == EINVAL, os_error("committing pages (madvise MADV_POPULATE_WRITE)", nbytes));
  // kernel before 5.14: fault the pages in by rewriting a byte of each (the range is not in use)
  const size_t page = page_size();
  for (size_t i = 0; i < static_cast<size_t>(nbytes); i += page) {
    volatile char* b = p + i;
    *b = *b;
  }
}

// Give the pages of a range back to the OS; the range reads as zeros afterwards.
void vmem_release(const torch::Tensor& buf, int64_t offset, int64_t nbytes) {
  char* p = range_of(buf, offset, nbytes);
  if (nbytes == 0) return;
  TORCH_CHECK(madvise(p, static_cast<size_t>(nbytes), MADV_DONTNEED) == 0,
              os_error("giving pages back (madvise MADV_DONTNEED)", nbytes));
}

// Bytes of a range backed by physical memory now (mincore).
int64_t vmem_resident(const torch::Tensor& buf, int64_t offset, int64_t nbytes) {
  char* p = range_of(buf, offset, nbytes);
  const size_t page = page_size(), pages = static_cast<size_t>(nbytes) / page;
  std::vector<unsigned char> in(pages);
  if (pages == 0) return 0;
  TORCH_CHECK(mincore(p, static_cast<size_t>(nbytes), in.data()) == 0, os_error("reading residency (mincore)", nbytes));
  int64_t count = 0;
  for (unsigned char c : in) count += c & 1;
  return count * static_cast<int64_t>(page);
}

int64_t vmem_page_size() { return static_cast<int64_t>(page_size()); }

#else  // not Linux

[[noreturn]] void unsupported() {
  TORCH_CHECK(false, "virtual KV: this platform lacks the Linux calls it needs (mmap MAP_NORESERVE, madvise)", kFallback);
}
torch::Tensor vmem_reserve(int64_t, bool) { unsupported(); }
void vmem_populate(const torch::Tensor&, int64_t, int64_t) { unsupported(); }
void vmem_release(const torch::Tensor&, int64_t, int64_t) { unsupported(); }
int64_t vmem_resident(const torch::Tensor&, int64_t, int64_t) { unsupported(); }
int64_t vmem_page_size() { unsupported(); }

#endif

}  // namespace

void bind_vmem(py::module& m) {
  m.def("vmem_reserve", &vmem_reserve, "reserve nbytes of address space, committed on first write (uint8 tensor)",
        py::arg("nbytes"), py::arg("huge_pages") = false);
  m.def("vmem_populate", &vmem_populate, "commit the pages of [offset, offset + nbytes) of a reservation",
        py::arg("buf"), py::arg("offset"), py::arg("nbytes"), py::call_guard<py::gil_scoped_release>());
  m.def("vmem_release", &vmem_release, "give the pages of [offset, offset + nbytes) back to the OS (reads as zeros)",
        py::arg("buf"), py::arg("offset"), py::arg("nbytes"), py::call_guard<py::gil_scoped_release>());
  m.def("vmem_resident", &vmem_resident, "bytes of [offset, offset + nbytes) resident in physical memory",
        py::arg("buf"), py::arg("offset"), py::arg("nbytes"));
  m.def("vmem_page_size", &vmem_page_size, "the OS page size in bytes");
}
