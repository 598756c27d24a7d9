//go:build !amd64 || purego

package vec

var impls = []impl{{"go", false}}

func use(impl) (restore func()) { return func() {} }
