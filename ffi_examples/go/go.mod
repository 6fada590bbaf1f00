module libserve

go 1.24
