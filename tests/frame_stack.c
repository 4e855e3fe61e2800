/* A cache of the interpreter's frame-stack chunks for the test processes (tests/frame_stack.py installs it).

   CPython 3.11 keeps Python frames on a stack of 16 KiB chunks, taken from and given back to the "arena allocator"
   (mmap and munmap). A chunk is given back as soon as the stack falls below it, so a loop whose calls cross a chunk's
   boundary maps and unmaps one per call: ~14 us instead of ~0.1 us (CPython issue gh-142183, fixed in 3.15 by a cached
   chunk). The Triton interpreter runs every kernel as deep Python calls, where the tests' stack crosses such a boundary
   by chance: a frame more or less under them moved their time by a fifth. This allocator keeps up to KEPT small blocks
   it is given back and hands them out again; any other size goes to mmap and munmap, as before. Every caller holds the
   GIL (the installer refuses a free-threaded build). */
#include <stddef.h>
#include <sys/mman.h>

#define KEPT 64
#define LARGEST_KEPT (64 * 1024)

static void *kept[KEPT];
static size_t kept_size[KEPT];
static int count;
static long reused;

void *frame_stack_alloc(void *ctx, size_t size) {
    (void)ctx;
    for (int i = count - 1; i >= 0; i--) {
        if (kept_size[i] == size) {
            void *block = kept[i];
            count--;
            kept[i] = kept[count];
            kept_size[i] = kept_size[count];
            reused++;
            return block;
        }
    }
    void *block = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return block == MAP_FAILED ? NULL : block;
}

void frame_stack_free(void *ctx, void *block, size_t size) {
    (void)ctx;
    if (size <= LARGEST_KEPT && count < KEPT) {
        kept[count] = block;
        kept_size[count] = size;
        count++;
        return;
    }
    munmap(block, size);
}

/* blocks handed out again, and blocks kept now: what the test of this cache reads */
long frame_stack_reused(void) { return reused; }
int frame_stack_kept(void) { return count; }
