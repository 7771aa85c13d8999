"""KV page allocator with automatic prefix caching (pure Python, no tensors).

Pages hold `page_size` tokens of every layer's cache. A page filled with computed tokens gets
a chained hash (hash of the previous page's hash and its own token ids); freed pages keep their
hash and sit in an LRU free list, so a later request that starts with the same tokens (an agent
loop resending its history) takes them back instead of prefilling again. A page is evicted
(its hash forgotten) only when it is reused for something else.
"""

from __future__ import annotations

from collections import OrderedDict


class KVPages:
    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True):
        self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, prefix_caching
        self.ref = [0] * num_pages
        self.page_hash: list[int | None] = [None] * num_pages
        self.free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self.by_hash: dict[int, int] = {}
        self.hits = 0  # prompt tokens served from the prefix cache
        self.queries = 0  # prompt tokens looked up

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_pages

    @staticmethod
    def chain_hashes(token_ids: list[int], page_size: int, max_pages: int, chain: list[int] | None = None) -> list[int]:
        """Chain hashes of the first max_pages pages; `chain` (hashes already computed for these
        tokens) is extended in place and returned, so only the new pages are hashed."""
        chain = [] if chain is None else chain
        while len(chain) < max_pages:
            i = len(chain)
            chain.append(hash((chain[-1] if chain else 0, tuple(token_ids[i * page_size : (i + 1) * page_size]))))
        return chain

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached pages covering a prefix of token_ids (always leaving >= 1 token to compute)."""
        full = (len(token_ids) - 1) // self.page_size
        self.queries += len(token_ids)
        if not self.prefix_caching or full == 0:
            return []
        pages = []
        for h in self.chain_hashes(token_ids, self.page_size, full):
            page = self.by_hash.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._take(page)
        self.hits += len(pages) * self.page_size
        return pages

    def _take(self, page: int) -> None:
        if self.ref[page] == 0:
            self.free.pop(page, None)
        self.ref[page] += 1

    def allocate(self, pages: list[int], num_tokens: int) -> bool:
        """Grow `pages` in place to hold num_tokens; False (and no change) if not enough free."""
        need = -(-num_tokens // self.page_size) - len(pages)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        for _ in range(need):
            page, _ = self.free.popitem(last=False)  # least recently freed first
            old = self.page_hash[page]
            if old is not None:
                if self.by_hash.get(old) == page:
                    del self.by_hash[old]
                self.page_hash[page] = None
            self.ref[page] = 1
            pages.append(page)
        return True

    def commit(self, pages: list[int], token_ids: list[int], num_computed: int, chain: list[int] | None = None) -> None:
        """Publish hashes of the pages now completely filled with computed tokens.

        chain: the sequence's chain hashes computed so far (extended in place). A sequence's
        tokens only ever grow, so its leading pages' hashes never change; keeping them makes a
        decode step hash one new page at most instead of every page of the context."""
        if not self.prefix_caching:
            return
        full = min(num_computed // self.page_size, len(pages))
        chain = self.chain_hashes(token_ids, self.page_size, full, chain)
        for i in range(full):
            h, page = chain[i], pages[i]
            if self.page_hash[page] is None and h not in self.by_hash:
                self.page_hash[page] = h
                self.by_hash[h] = page

    def release(self, pages: list[int]) -> None:
        # Free in reverse so a sequence's tail pages are evicted before its shared prefix.
        for page in reversed(pages):
            self.ref[page] -= 1
            if self.ref[page] == 0:
                self.free[page] = None
        pages.clear()
