package engine

// The arithmetic of Device.Gemm and Device.GemmLD that every backend checks alike.

// ContiguousLDs are the leading dimensions of op(A) (m×k) and op(B) (k×n) stored contiguously
// row-major, at least 1: Gemm is GemmLD with these and ldc = max(n, 1).
func ContiguousLDs(transA, transB bool, m, n, k int) (lda, ldb int) {
	lda, ldb = k, n
	if transA {
		lda = m
	}
	if transB {
		ldb = k
	}
	return max(lda, 1), max(ldb, 1)
}

// StridedLen is the extent of a rows×cols row-major matrix whose rows lie ld apart.
func StridedLen(rows, cols, ld int) int {
	if rows == 0 || cols == 0 {
		return 0
	}
	return (rows-1)*ld + cols
}

// GemmFits reports whether GemmLD's operands are consistent: non-negative sizes, leading
// dimensions at least the stored row lengths, and views covering the strided extents.
func GemmFits(transA, transB bool, m, n, k int, aN, lda, bN, ldb, cN, ldc int) bool {
	ar, ac := m, k // A as stored
	if transA {
		ar, ac = k, m
	}
	br, bc := k, n
	if transB {
		br, bc = n, k
	}
	return m >= 0 && n >= 0 && k >= 0 && lda >= max(ac, 1) && ldb >= max(bc, 1) && ldc >= max(n, 1) &&
		aN >= StridedLen(ar, ac, lda) && bN >= StridedLen(br, bc, ldb) && cN >= StridedLen(m, n, ldc)
}
