package engine

import "math"

// The reference device's operations for transformer layers (and BatchNorm): each is its
// definition in plain Go, reading the inputs in their types, computing in fp32 with float64
// sums for the reductions, and rounding once when it stores.

// GemmBatchedFits reports whether GemmBatched's operands are consistent: non-negative strides
// (strideC positive when batch > 1: the products must not write the same C), and views that
// cover the last product's strided extents. Every backend checks alike.
func GemmBatchedFits(transA, transB bool, m, n, k int, aN, lda, strideA, bN, ldb, strideB, cN, ldc, strideC, batch int) bool {
	if batch < 0 || strideA < 0 || strideB < 0 || strideC < 0 || (batch > 1 && strideC == 0) {
		return false
	}
	if batch == 0 {
		return m >= 0 && n >= 0 && k >= 0
	}
	last := batch - 1
	return GemmFits(transA, transB, m, n, k, aN-last*strideA, lda, bN-last*strideB, ldb, cN-last*strideC, ldc)
}

// CopyRowsFits reports whether CopyRows' views cover their strided extents (ldSrc 0: one row).
func CopyRowsFits(dstN, ldDst, srcN, ldSrc, rows, cols int) bool {
	return rows >= 0 && cols >= 0 && ldDst >= max(cols, 1) && (ldSrc == 0 || ldSrc >= cols) &&
		dstN >= StridedLen(rows, cols, ldDst) && srcN >= StridedLen(rows, cols, ldSrc)
}

// PatchifyFits reports whether Patchify's (or Unpatchify's) shape is valid and its buffers
// have the sizes it implies.
func PatchifyFits(colsN, xN, n, c, h, w, p int) bool {
	return n >= 0 && c > 0 && p > 0 && h > 0 && w > 0 && h%p == 0 && w%p == 0 &&
		xN == n*c*h*w && colsN == xN
}

func (h *Reference) GemmBatched(transA, transB bool, m, n, k int, alpha float32, a Buf, lda, strideA int, b Buf, ldb, strideB int, beta float32, c Buf, ldc, strideC int, batch int) {
	if !h.check(GemmBatchedFits(transA, transB, m, n, k, a.N, lda, strideA, b.N, ldb, strideB, c.N, ldc, strideC, batch),
		"gemm_batched %d × %dx%dx%d (ld %d, %d, %d; strides %d, %d, %d) on buffers of %d, %d, %d",
		batch, m, n, k, lda, ldb, ldc, strideA, strideB, strideC, a.N, b.N, c.N) {
		return
	}
	for i := 0; i < batch && h.err == nil; i++ {
		h.GemmLD(transA, transB, m, n, k, alpha, a.Slice(i*strideA, a.N), lda, b.Slice(i*strideB, b.N), ldb,
			beta, c.Slice(i*strideC, c.N), ldc)
	}
}

func (h *Reference) Axpby(y, x Buf, a, b float32) {
	Y, X := h.f(y), h.f(x)
	if Y == nil || X == nil || !h.check(len(Y) == len(X), "axpby of %d into %d", len(X), len(Y)) {
		return
	}
	for i, v := range X {
		r := a * v
		if b != 0 { // b 0: y is not read, as beta 0 in Gemm
			r += b * Y[i]
		}
		Y[i] = round1(r, y.T)
	}
}

func (h *Reference) CopyRows(dst Buf, ldDst int, src Buf, ldSrc int, rows, cols int) {
	D, S := h.f(dst), h.f(src)
	if D == nil || S == nil || !h.check(CopyRowsFits(len(D), ldDst, len(S), ldSrc, rows, cols),
		"copy_rows %dx%d (ld %d into ld %d) from %d into %d elements", rows, cols, ldSrc, ldDst, len(S), len(D)) {
		return
	}
	for r := 0; r < rows; r++ {
		for c := 0; c < cols; c++ {
			D[r*ldDst+c] = round1(S[r*ldSrc+c], dst.T)
		}
	}
}

// sumF64 is Σ x in float64.
func sumF64(x []float32) float64 {
	var s float64
	for _, v := range x {
		s += float64(v)
	}
	return s
}

// normStats are a group's mean and 1/sqrt(σ² + eps) (σ² biased), summed in float64 and
// rounded to fp32 as they are stored.
func normStats(sum func(f func(v float32)), count int, eps float32) (mean, rstd float32) {
	var s float64
	sum(func(v float32) { s += float64(v) })
	mu := s / float64(max(count, 1))
	var q float64
	sum(func(v float32) { d := float64(v) - mu; q += d * d })
	v := q / float64(max(count, 1))
	return float32(mu), float32(1 / math.Sqrt(v+float64(eps)))
}

func (h *Reference) LayerNorm(y, mean, rstd, x, gamma, beta Buf, rows, cols int, eps float32) {
	Y, M, R, X, G, B := h.f(y), h.f(mean), h.f(rstd), h.f(x), h.f(gamma), h.f(beta)
	if Y == nil || M == nil || R == nil || X == nil || G == nil || B == nil {
		return
	}
	if !h.check(rows >= 0 && cols > 0 && len(X) == rows*cols && len(Y) == len(X) && len(G) == cols && len(B) == cols &&
		len(M) == rows && len(R) == rows && mean.T == F32 && rstd.T == F32,
		"layer_norm %dx%d: buffers of %d, %d (gamma %d, beta %d, mean %d %v, rstd %d %v)",
		rows, cols, len(X), len(Y), len(G), len(B), len(M), mean.T, len(R), rstd.T) {
		return
	}
	for r := 0; r < rows; r++ {
		xr, yr := X[r*cols:(r+1)*cols], Y[r*cols:(r+1)*cols]
		mf, rf := normStats(func(f func(float32)) {
			for _, v := range xr {
				f(v)
			}
		}, cols, eps)
		M[r], R[r] = mf, rf
		for c, v := range xr { // y may alias x: each element is read before it is written
			yr[c] = round1((v-mf)*rf*G[c]+B[c], y.T)
		}
	}
}

func (h *Reference) LayerNormBackward(dx, dgamma, dbeta, dy, x, mean, rstd, gamma Buf, rows, cols int, b float32) {
	DY, X, M, R, G := h.f(dy), h.f(x), h.f(mean), h.f(rstd), h.f(gamma)
	if DY == nil || X == nil || M == nil || R == nil || G == nil {
		return
	}
	if !h.check(rows >= 0 && cols > 0 && len(X) == rows*cols && len(DY) == len(X) && len(G) == cols && len(M) == rows && len(R) == rows &&
		mean.T == F32 && rstd.T == F32, "layer_norm_backward %dx%d: buffers of %d, %d (gamma %d, mean %d %v, rstd %d %v)",
		rows, cols, len(X), len(DY), len(G), len(M), mean.T, len(R), rstd.T) {
		return
	}
	var DX, DG, DB []float32
	if dx.Valid() {
		if DX = h.f(dx); DX == nil || !h.check(len(DX) == len(X), "layer_norm_backward: dx of %d for %d", len(DX), len(X)) {
			return
		}
	}
	if dgamma.Valid() {
		if DG = h.f(dgamma); DG == nil || !h.check(len(DG) == cols, "layer_norm_backward: dgamma of %d for %d", len(DG), cols) {
			return
		}
	}
	if dbeta.Valid() {
		if DB = h.f(dbeta); DB == nil || !h.check(len(DB) == cols, "layer_norm_backward: dbeta of %d for %d", len(DB), cols) {
			return
		}
	}
	xhat := func(r, c int) float32 { return (X[r*cols+c] - M[r]) * R[r] }
	// The parameter gradients first: dx may alias dy.
	if DG != nil || DB != nil {
		sg, sb := make([]float64, cols), make([]float64, cols)
		for r := 0; r < rows; r++ {
			for c := 0; c < cols; c++ {
				g := DY[r*cols+c]
				sg[c] += float64(g * xhat(r, c))
				sb[c] += float64(g)
			}
		}
		store := func(D []float32, s []float64, t DType) {
			for c, v := range s {
				if b != 0 {
					v += float64(b * D[c])
				}
				D[c] = round1(float32(v), t)
			}
		}
		if DG != nil {
			store(DG, sg, dgamma.T)
		}
		if DB != nil {
			store(DB, sb, dbeta.T)
		}
	}
	if DX == nil {
		return
	}
	row := make([]float32, cols)
	for r := 0; r < rows; r++ {
		var s1, s2 float64
		for c := 0; c < cols; c++ {
			g := DY[r*cols+c] * G[c]
			s1 += float64(g)
			s2 += float64(g * xhat(r, c))
		}
		m1, m2 := float32(s1/float64(cols)), float32(s2/float64(cols))
		for c := 0; c < cols; c++ {
			row[c] = R[r] * (DY[r*cols+c]*G[c] - m1 - xhat(r, c)*m2)
		}
		for c, v := range row {
			DX[r*cols+c] = round1(v, dx.T)
		}
	}
}

// gaussCDF is Φ(x), the standard normal CDF.
func gaussCDF(x float64) float64 { return 0.5 * math.Erfc(-x/math.Sqrt2) }

// gaussPDF is φ(x).
func gaussPDF(x float64) float64 { return math.Exp(-x*x/2) / math.Sqrt(2*math.Pi) }

func (h *Reference) GELU(y, x Buf) {
	Y, X := h.f(y), h.f(x)
	if Y == nil || X == nil || !h.check(len(Y) == len(X), "gelu of %d into %d", len(X), len(Y)) {
		return
	}
	for i, v := range X {
		Y[i] = round1(float32(float64(v)*gaussCDF(float64(v))), y.T)
	}
}

func (h *Reference) GELUGrad(dx, dy, x Buf) {
	DX, DY, X := h.f(dx), h.f(dy), h.f(x)
	if DX == nil || DY == nil || X == nil || !h.check(len(DX) == len(DY) && len(DY) == len(X), "gelu_grad lengths %d, %d, %d", len(DX), len(DY), len(X)) {
		return
	}
	for i, v := range X {
		xv := float64(v)
		DX[i] = round1(DY[i]*float32(gaussCDF(xv)+xv*gaussPDF(xv)), dx.T)
	}
}

func (h *Reference) Dropout(y, x Buf, p float32, seed uint64) {
	Y, X := h.f(y), h.f(x)
	if Y == nil || X == nil || !h.check(len(Y) == len(X), "dropout of %d into %d", len(X), len(Y)) {
		return
	}
	for i, v := range X {
		if DropoutKeep(seed, uint64(i), p) {
			Y[i] = round1(v/(1-p), y.T)
		} else {
			Y[i] = 0
		}
	}
}

func (h *Reference) Softmax(y, x Buf, rows, cols int, scale float32) {
	Y, X := h.f(y), h.f(x)
	if Y == nil || X == nil || !h.check(rows >= 0 && cols > 0 && len(X) == rows*cols && len(Y) == len(X),
		"softmax %dx%d on buffers of %d and %d", rows, cols, len(X), len(Y)) {
		return
	}
	e := make([]float64, cols)
	for r := 0; r < rows; r++ {
		xr, yr := X[r*cols:(r+1)*cols], Y[r*cols:(r+1)*cols]
		m := scale * xr[0]
		for _, v := range xr {
			m = max(m, scale*v)
		}
		var sum float64
		for c, v := range xr {
			e[c] = math.Exp(float64(scale*v - m))
			sum += e[c]
		}
		for c := range yr {
			yr[c] = round1(float32(e[c]/sum), y.T)
		}
	}
}

func (h *Reference) SoftmaxGrad(dx, dy, y Buf, rows, cols int, scale float32) {
	DX, DY, Y := h.f(dx), h.f(dy), h.f(y)
	if DX == nil || DY == nil || Y == nil || !h.check(rows >= 0 && cols > 0 && len(Y) == rows*cols && len(DY) == len(Y) && len(DX) == len(Y),
		"softmax_grad %dx%d on buffers of %d, %d, %d", rows, cols, len(DX), len(DY), len(Y)) {
		return
	}
	for r := 0; r < rows; r++ {
		o := r * cols
		var dot float64
		for c := 0; c < cols; c++ {
			dot += float64(DY[o+c] * Y[o+c])
		}
		d := float32(dot)
		for c := 0; c < cols; c++ {
			DX[o+c] = round1(scale*Y[o+c]*(DY[o+c]-d), dx.T)
		}
	}
}

// patchIndex calls f(ci, xi) for every element of a Patchify: ci its index in cols, xi in x.
func patchIndex(n, c, hh, w, p int, f func(ci, xi int)) {
	ph, pw := hh/p, w/p
	ci := 0
	for s := 0; s < n; s++ {
		for py := 0; py < ph; py++ {
			for px := 0; px < pw; px++ {
				for ch := 0; ch < c; ch++ {
					for i := 0; i < p; i++ {
						xi := ((s*c+ch)*hh+py*p+i)*w + px*p
						for j := 0; j < p; j++ {
							f(ci, xi+j)
							ci++
						}
					}
				}
			}
		}
	}
}

func (h *Reference) Patchify(cols, x Buf, n, c, hh, w, p int) {
	C, X := h.f(cols), h.f(x)
	if C == nil || X == nil || !h.check(PatchifyFits(len(C), len(X), n, c, hh, w, p), "patchify %dx%dx%dx%d by %d: buffers of %d and %d", n, c, hh, w, p, len(C), len(X)) {
		return
	}
	patchIndex(n, c, hh, w, p, func(ci, xi int) { C[ci] = round1(X[xi], cols.T) })
}

func (h *Reference) Unpatchify(dx, cols Buf, n, c, hh, w, p int) {
	D, C := h.f(dx), h.f(cols)
	if D == nil || C == nil || !h.check(PatchifyFits(len(C), len(D), n, c, hh, w, p), "unpatchify %dx%dx%dx%d by %d: buffers of %d and %d", n, c, hh, w, p, len(C), len(D)) {
		return
	}
	patchIndex(n, c, hh, w, p, func(ci, xi int) { D[xi] = round1(C[ci], dx.T) })
}

// bnCheck checks a BatchNorm's shapes.
func (h *Reference) bnCheck(op string, x, y, mean, rstd, gamma []float32, mt, rt DType, n, c, hw int) bool {
	return x != nil && y != nil && mean != nil && rstd != nil && gamma != nil &&
		h.check(n >= 0 && c > 0 && hw > 0 && len(x) == n*c*hw && len(y) == len(x) && len(gamma) == c && len(mean) == c && len(rstd) == c &&
			mt == F32 && rt == F32, "%s %dx%dx%d: buffers of %d, %d (gamma %d, mean %d %v, rstd %d %v)",
			op, n, c, hw, len(x), len(y), len(gamma), len(mean), mt, len(rstd), rt)
}

// channel calls f for every element of channel ch of an n×c×hw array, in order.
func channel(X []float32, n, c, hw, ch int, f func(i int)) {
	for s := 0; s < n; s++ {
		o := (s*c + ch) * hw
		for i := o; i < o+hw; i++ {
			f(i)
		}
	}
}

func (h *Reference) BatchNorm(y, mean, rstd, x, gamma, beta Buf, n, c, hw int, eps float32, train bool) {
	Y, M, R, X, G, B := h.f(y), h.f(mean), h.f(rstd), h.f(x), h.f(gamma), h.f(beta)
	if !h.bnCheck("batch_norm", X, Y, M, R, G, mean.T, rstd.T, n, c, hw) || B == nil || !h.check(len(B) == c, "batch_norm: %d biases for %d channels", len(B), c) {
		return
	}
	for ch := 0; ch < c; ch++ {
		if train {
			M[ch], R[ch] = normStats(func(f func(float32)) { channel(X, n, c, hw, ch, func(i int) { f(X[i]) }) }, n*hw, eps)
		}
		mf, rf, g, bv := M[ch], R[ch], G[ch], B[ch]
		channel(X, n, c, hw, ch, func(i int) { Y[i] = round1((X[i]-mf)*rf*g+bv, y.T) })
	}
}

func (h *Reference) BatchNormBackward(dx, dgamma, dbeta, dy, x, mean, rstd, gamma Buf, n, c, hw int, b float32) {
	DY, X, M, R, G := h.f(dy), h.f(x), h.f(mean), h.f(rstd), h.f(gamma)
	if !h.bnCheck("batch_norm_backward", X, DY, M, R, G, mean.T, rstd.T, n, c, hw) {
		return
	}
	var DX, DG, DB []float32
	if dx.Valid() {
		if DX = h.f(dx); DX == nil || !h.check(len(DX) == len(X), "batch_norm_backward: dx of %d for %d", len(DX), len(X)) {
			return
		}
	}
	if dgamma.Valid() {
		if DG = h.f(dgamma); DG == nil || !h.check(len(DG) == c, "batch_norm_backward: dgamma of %d for %d channels", len(DG), c) {
			return
		}
	}
	if dbeta.Valid() {
		if DB = h.f(dbeta); DB == nil || !h.check(len(DB) == c, "batch_norm_backward: dbeta of %d for %d channels", len(DB), c) {
			return
		}
	}
	count := float64(max(n*hw, 1))
	for ch := 0; ch < c; ch++ {
		mf, rf := M[ch], R[ch]
		var s1, s2 float64
		channel(X, n, c, hw, ch, func(i int) {
			s1 += float64(DY[i])
			s2 += float64(DY[i] * ((X[i] - mf) * rf))
		})
		if DG != nil {
			v := s2
			if b != 0 {
				v += float64(b * DG[ch])
			}
			DG[ch] = round1(float32(v), dgamma.T)
		}
		if DB != nil {
			v := s1
			if b != 0 {
				v += float64(b * DB[ch])
			}
			DB[ch] = round1(float32(v), dbeta.T)
		}
		if DX != nil {
			m1, m2, gr := float32(s1/count), float32(s2/count), G[ch]*rf
			channel(X, n, c, hw, ch, func(i int) { DX[i] = round1(gr*(DY[i]-m1-(X[i]-mf)*rf*m2), dx.T) })
		}
	}
}
