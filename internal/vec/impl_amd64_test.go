//go:build amd64 && !purego

package vec

// impls lists the implementations a test can select on this machine: the assembly kernels
// when the CPU has them, and always the Go loops.
var impls = func() []impl {
	if useAVX2 {
		return []impl{{"avx2", true}, {"go", false}}
	}
	return []impl{{"go", false}}
}()

// use selects an implementation for the code that follows and returns a function that
// restores the previous one.
func use(im impl) (restore func()) {
	old := useAVX2
	useAVX2 = im.asm
	return func() { useAVX2 = old }
}
